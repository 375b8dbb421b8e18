#include "common/glibc_tunables.h"

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"

namespace zeroshard {

std::optional<absl::string_view> NonTemporalThresholdIn(absl::string_view tunables) {
  for (absl::string_view t : absl::StrSplit(tunables, ':')) {
    if (absl::ConsumePrefix(&t, kNonTemporalThresholdTunable) && absl::ConsumePrefix(&t, "=")) {
      return t;
    }
  }
  return std::nullopt;
}

}  // namespace zeroshard
