#include "metrics/family.h"

#include <string>

#include "absl/base/internal/raw_logging.h"

namespace zeroshard::metrics {

void FamilyBase::LogDropped(const absl::Status& status) {
  const std::string message(status.message());
  ABSL_RAW_LOG(ERROR, "metrics: %s; updates go to a detached metric",
               message.c_str());
}

}  // namespace zeroshard::metrics
