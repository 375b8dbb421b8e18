#include "common/format.h"

#include <cmath>
#include <cstdio>

#include "absl/strings/string_view.h"

namespace zeroshard {

std::string FormatSig3(double v) {
  if (v == 0 || !std::isfinite(v)) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", v);
    return buf;
  }
  int digits = static_cast<int>(std::floor(std::log10(std::fabs(v))));
  double rounded = std::round(v / std::pow(10.0, digits - 2)) * std::pow(10.0, digits - 2);
  // Rounding may carry into a new digit (999.7 -> 1000): recount.
  digits = static_cast<int>(std::floor(std::log10(std::fabs(rounded))));
  rounded = std::round(v / std::pow(10.0, digits - 2)) * std::pow(10.0, digits - 2);
  const int decimals = digits >= 2 ? 0 : 2 - digits;
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, rounded);
  return buf;
}

namespace {
std::string WithUnit(double v, const char* const* units, int n, double step, const char* sep) {
  int u = 0;
  while (std::fabs(v) >= 999.5 && u + 1 < n) {
    v /= step;
    ++u;
  }
  return FormatSig3(v) + sep + units[u];
}
}  // namespace

std::string PadRight(absl::string_view s, size_t width) {
  size_t chars = 0;
  for (unsigned char c : s) chars += (c & 0xc0) != 0x80;
  std::string out(s);
  if (chars < width) out.append(width - chars, ' ');
  return out;
}

std::string PadLeft(absl::string_view s, size_t width) {
  size_t chars = 0;
  for (unsigned char c : s) chars += (c & 0xc0) != 0x80;
  std::string out;
  if (chars < width) out.append(width - chars, ' ');
  out.append(s.data(), s.size());
  return out;
}

std::string FormatBytes(double bytes) {
  static const char* const kUnits[] = {"B", "kB", "MB", "GB", "TB", "PB", "EB"};
  if (std::fabs(bytes) < 1000) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.0f B", bytes);
    return buf;
  }
  return WithUnit(bytes, kUnits, 7, 1000, " ");
}

std::string FormatCount(double count) {
  static const char* const kUnits[] = {"", "K", "M", "B", "T", "P"};
  return WithUnit(count, kUnits, 6, 1000, "");
}

}  // namespace zeroshard
