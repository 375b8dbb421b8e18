#pragma once

// What a job id may be, for the client and the daemon alike (it names the job
// in RPCs, metrics labels and log lines).

#include "absl/strings/string_view.h"

namespace zeroshard {

// The rule, as error messages state it.
inline constexpr char kJobIdRule[] = "1..128 bytes of [A-Za-z0-9._-], not \".\" or \"..\"";

// True iff `id` follows kJobIdRule.
bool IsValidJobId(absl::string_view id);

}  // namespace zeroshard
