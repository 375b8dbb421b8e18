#pragma once

// A metric family: one name, help text, type and set of label names, holding
// one series (a Counter, Gauge or Histogram) per distinct label set. Families
// are created by a Registry (see registry.h) and live as long as it.
//
// Thread-safety: every member may be called from any thread. Add/Remove take
// the family's lock (briefly, allocating on first Add of a label set); the
// returned metric is then updated without touching the family.

#include <cmath>
#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "metrics/histogram.h"
#include "metrics/metric_family.h"
#include "metrics/metric_spec.h"
#include "metrics/validation.h"

namespace zeroshard::metrics {

class Registry;

// What a Builder collects; validated by the Registry.
struct FamilyOptions {
  std::string name;
  std::string help;
  MetricType type = MetricType::kGauge;
  std::vector<std::string> label_names;
  // Histograms: boundaries for series added without their own.
  std::vector<double> buckets;
};

class FamilyBase {
 public:
  FamilyBase(const FamilyBase&) = delete;
  FamilyBase& operator=(const FamilyBase&) = delete;
  virtual ~FamilyBase() = default;

  const std::string& name() const { return options_.name; }
  const std::string& help() const { return options_.help; }
  MetricType type() const { return options_.type; }
  const std::vector<std::string>& label_names() const {
    return options_.label_names;
  }
  // Histograms: default finite bucket bounds (no trailing +Inf).
  const std::vector<double>& buckets() const { return options_.buckets; }

  // Removes every series whose label `label_name` has value `label_value` and
  // returns how many went. References to removed series dangle: the caller
  // makes sure no other thread still uses them.
  virtual std::size_t RemoveIf(absl::string_view label_name,
                               absl::string_view label_value) = 0;

  // Number of series.
  virtual std::size_t size() const = 0;

  // A snapshot of every series, ordered by labels. Each series is read
  // consistently; different series are read one after another.
  virtual MetricFamily Collect() const = 0;

 protected:
  explicit FamilyBase(FamilyOptions options) : options_(std::move(options)) {}

  // Logs an error from the reference-returning API, which cannot return it.
  static void LogDropped(const absl::Status& status);

 private:
  const FamilyOptions options_;
};

template <typename T>
class Family final : public FamilyBase {
 public:
  // The series for `labels`, created on first use (later calls return the
  // same object). The reference stays valid until the series is removed.
  //
  // On invalid labels (names other than the declared ones, values that are
  // not UTF-8) this logs the error and returns a detached metric that is
  // never exported, so a caller never crashes on bad input; use TryAdd to
  // get the error instead.
  T& Add(const Labels& labels) {
    absl::StatusOr<T*> metric = TryAddImpl(labels, nullptr);
    if (metric.ok()) return **metric;
    LogDropped(metric.status());
    return Detached();
  }

  // As Add, but returns InvalidArgument on invalid labels.
  absl::StatusOr<T*> TryAdd(const Labels& labels) {
    return TryAddImpl(labels, nullptr);
  }

  // Histograms: a series with its own bucket bounds instead of the family's.
  // If the series exists with other bounds, TryAdd fails (InvalidArgument)
  // and Add logs and returns a detached histogram.
  template <typename U = T,
            std::enable_if_t<std::is_same_v<U, Histogram>, int> = 0>
  U& Add(const Labels& labels, const Histogram::BucketBoundaries& buckets) {
    absl::StatusOr<T*> metric = TryAddImpl(labels, &buckets);
    if (metric.ok()) return **metric;
    LogDropped(metric.status());
    return Detached();
  }
  template <typename U = T,
            std::enable_if_t<std::is_same_v<U, Histogram>, int> = 0>
  absl::StatusOr<U*> TryAdd(const Labels& labels,
                            const Histogram::BucketBoundaries& buckets) {
    return TryAddImpl(labels, &buckets);
  }

  // Removes the series `metric` (from Add/TryAdd of this family); a null,
  // detached or foreign pointer is ignored. `metric` dangles afterwards.
  void Remove(T* metric) {
    absl::MutexLock lock(&mu_);
    for (auto it = series_.begin(); it != series_.end(); ++it) {
      if (it->second.get() == metric) {
        series_.erase(it);
        return;
      }
    }
  }

  bool Has(const Labels& labels) const {
    absl::ReaderMutexLock lock(&mu_);
    return series_.count(labels) > 0;
  }

  std::size_t RemoveIf(absl::string_view label_name,
                       absl::string_view label_value) override {
    std::size_t removed = 0;
    absl::MutexLock lock(&mu_);
    for (auto it = series_.begin(); it != series_.end();) {
      auto label = it->first.find(std::string(label_name));
      if (label != it->first.end() && label->second == label_value) {
        it = series_.erase(it);
        ++removed;
      } else {
        ++it;
      }
    }
    return removed;
  }

  std::size_t size() const override {
    absl::ReaderMutexLock lock(&mu_);
    return series_.size();
  }

  MetricFamily Collect() const override {
    MetricFamily family;
    family.name = name();
    family.help = help();
    family.type = type();
    absl::ReaderMutexLock lock(&mu_);
    family.metrics.reserve(series_.size());
    for (const auto& [labels, metric] : series_) {
      family.metrics.push_back(metric->Collect());
      family.metrics.back().labels = labels;
    }
    return family;
  }

 private:
  friend class Registry;

  explicit Family(FamilyOptions options) : FamilyBase(std::move(options)) {}

  absl::StatusOr<T*> TryAddImpl(const Labels& labels,
                                const std::vector<double>* buckets) {
    if (absl::Status s = ValidateLabels(labels, label_names()); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name(), ": ", s.message()));
    }
    std::vector<double> bounds =
        buckets == nullptr ? this->buckets() : *buckets;
    if (buckets != nullptr) {
      if (absl::Status s = ValidateBucketBoundaries(bounds); !s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(name(), ": ", s.message()));
      }
      if (!bounds.empty() && std::isinf(bounds.back())) bounds.pop_back();
    }
    absl::MutexLock lock(&mu_);
    auto it = series_.find(labels);
    if (it == series_.end()) {
      it = series_.emplace(labels, NewMetric(bounds)).first;
    } else if constexpr (std::is_same_v<T, Histogram>) {
      if (buckets != nullptr && it->second->boundaries() != bounds) {
        return absl::InvalidArgumentError(absl::StrCat(
            name(), ": series exists with different bucket boundaries"));
      }
    }
    return it->second.get();
  }

  T& Detached() {
    absl::MutexLock lock(&mu_);
    if (detached_ == nullptr) detached_ = NewMetric(buckets());
    return *detached_;
  }

  static std::unique_ptr<T> NewMetric(const std::vector<double>& buckets) {
    if constexpr (std::is_same_v<T, Histogram>) {
      return std::make_unique<Histogram>(buckets);
    } else {
      return std::make_unique<T>();
    }
  }

  mutable absl::Mutex mu_;
  std::map<Labels, std::unique_ptr<T>> series_ ABSL_GUARDED_BY(mu_);
  // Handed out by Add on invalid input; never collected.
  std::unique_ptr<T> detached_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard::metrics
