#include "metrics/registry.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/str_cat.h"
#include "metrics/validation.h"

namespace zeroshard::metrics {
namespace {

// The sample names a family writes; two families must not share any.
std::vector<std::string> SampleNames(const std::string& name, MetricType type) {
  if (type != MetricType::kHistogram) return {name};
  return {name, name + "_bucket", name + "_sum", name + "_count"};
}

std::vector<std::string> Sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

std::vector<MetricFamily> Registry::Collect() const {
  std::vector<MetricFamily> families;
  absl::ReaderMutexLock lock(&mu_);
  families.reserve(families_.size());
  for (const auto& [name, family] : families_) {
    MetricFamily collected = family->Collect();
    if (!collected.metrics.empty()) families.push_back(std::move(collected));
  }
  return families;
}

std::size_t Registry::RemoveIf(absl::string_view label_name,
                               absl::string_view label_value) {
  std::size_t removed = 0;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [name, family] : families_) {
    removed += family->RemoveIf(label_name, label_value);
  }
  return removed;
}

absl::Status Registry::CheckLocked(FamilyOptions& options,
                                   FamilyBase** existing) const {
  *existing = nullptr;
  if (absl::Status s = ValidateMetricName(options.name); !s.ok()) return s;
  if (options.help.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.name, ": help text is empty"));
  }
  if (absl::Status s = ValidateLabelValue(options.help); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.name, ": help text is not valid UTF-8"));
  }
  if (absl::Status s = ValidateLabelNames(options.label_names, options.type);
      !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.name, ": ", s.message()));
  }
  if (options.type == MetricType::kHistogram) {
    if (absl::Status s = ValidateBucketBoundaries(options.buckets); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(options.name, ": ", s.message()));
    }
    if (!options.buckets.empty() && std::isinf(options.buckets.back())) {
      options.buckets.pop_back();
    }
  } else if (!options.buckets.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.name, ": only histograms have buckets"));
  }

  if (auto it = families_.find(options.name); it != families_.end()) {
    const FamilyBase& old = *it->second;
    if (old.type() != options.type) {
      return absl::AlreadyExistsError(
          absl::StrCat(options.name, " is already registered as a ",
                       MetricTypeName(old.type()), ", not a ",
                       MetricTypeName(options.type)));
    }
    if (Sorted(old.label_names()) != Sorted(options.label_names)) {
      return absl::AlreadyExistsError(absl::StrCat(
          options.name, " is already registered with other label names"));
    }
    if (old.buckets() != options.buckets) {
      return absl::AlreadyExistsError(absl::StrCat(
          options.name, " is already registered with other buckets"));
    }
    *existing = it->second.get();
    return absl::OkStatus();
  }

  const std::vector<std::string> mine = SampleNames(options.name, options.type);
  for (const auto& [name, family] : families_) {
    for (const std::string& theirs : SampleNames(name, family->type())) {
      if (std::find(mine.begin(), mine.end(), theirs) != mine.end()) {
        return absl::AlreadyExistsError(
            absl::StrCat(options.name, " would write samples named ", theirs,
                         ", as family ", name, " does"));
      }
    }
  }
  return absl::OkStatus();
}

void Registry::LogDropped(const absl::Status& status) {
  const std::string message(status.message());
  ABSL_RAW_LOG(ERROR, "metrics: %s; its updates are not exported",
               message.c_str());
}

}  // namespace zeroshard::metrics
