#include "tools/json_output.h"

#include <cmath>
#include <cstdint>

namespace zeroshard::tools {

Json JsonNumber(double value) {
  if (!std::isfinite(value)) return nullptr;
  constexpr double kExact = 9007199254740992.0;  // 2^53
  if (value == std::trunc(value) && std::fabs(value) <= kExact) {
    if (value >= 0) return static_cast<uint64_t>(value);
    return static_cast<int64_t>(value);
  }
  return value;
}

std::string JsonDocument(const Json& document) {
  return document.dump(-1, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace) + "\n";
}

}  // namespace zeroshard::tools
