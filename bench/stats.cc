#include "bench/stats.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/glibc_tunables.h"

namespace zeroshard::bench {

double Median(std::vector<double> values) {
  if (values.empty()) return NAN;
  std::sort(values.begin(), values.end());
  const size_t m = values.size() / 2;
  return values.size() % 2 == 1 ? values[m] : (values[m - 1] + values[m]) / 2;
}

std::string DescribeCopyThreshold() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (std::optional<absl::string_view> value =
          NonTemporalThresholdIn(tunables != nullptr ? tunables : "");
      value.has_value()) {
    uint64_t bytes = 0;
    const bool taken = absl::SimpleAtoi(*value, &bytes) && bytes >= kGlibcMinNonTemporalThreshold;
    return absl::StrCat("glibc non-temporal copy threshold: ", *value, " B (GLIBC_TUNABLES",
                        taken ? ")" : "; glibc ignores it: not a number of at least 16448)");
  }
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return absl::StrCat("glibc non-temporal copy threshold: glibc's default, from the ",
                      l3 > 0 ? absl::StrCat(l3 >> 20, " MiB") : std::string("unknown"),
                      " of L3 the CPU reports (GLIBC_TUNABLES does not set it)");
}

}  // namespace zeroshard::bench
