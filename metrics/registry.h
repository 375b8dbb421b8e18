#pragma once

// The process's metric registry and the builders that register families in
// it, modelled on prometheus-cpp:
//
//   Registry registry;  // one per process, owned by main()
//   Family<Gauge>& memory = BuildGauge()
//                               .Name("zeroshard_memory_bytes")
//                               .Help("Bytes held, by job and category.")
//                               .Labels({"job", "category"})
//                               .Register(registry);
//   Gauge& grad = memory.Add({{"job", "a"}, {"category", "grad"}});
//   grad.Set(1 << 20);  // lock-free, from any thread
//   ...
//   registry.RemoveIf("job", "a");  // job "a" left: drop all of its series
//
// Unlike prometheus-cpp, Labels() declares the family's label *names*; every
// series must use exactly those. There are no constant labels.

#include <cstddef>
#include <map>
#include <memory>
#include <optional>
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
#include "metrics/counter.h"
#include "metrics/family.h"
#include "metrics/gauge.h"
#include "metrics/histogram.h"
#include "metrics/metric_family.h"
#include "metrics/metric_spec.h"

namespace zeroshard::metrics {

template <typename T>
class Builder;

// Thread-safe. Families, once registered, live as long as the registry, so
// references to them (and to their series, until removed) stay valid.
class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;
  ~Registry() = default;

  // A snapshot of every family that has at least one series, ordered by
  // name; see FamilyBase::Collect for what "snapshot" guarantees. Takes the
  // registry's and each family's lock in turn as a reader, so Add/Remove and
  // registration wait for it; counter and gauge updates never do, a
  // histogram's Observe only while that histogram is copied.
  std::vector<MetricFamily> Collect() const;

  // Removes, in every family, the series whose label `label_name` has value
  // `label_value` (e.g. "job", "a" when job a leaves). Returns the number of
  // series removed; references to them dangle afterwards.
  std::size_t RemoveIf(absl::string_view label_name,
                       absl::string_view label_value);

 private:
  template <typename T>
  friend class Builder;

  // Registers a family, or returns the existing one of the same name when
  // type, label names and (histograms) buckets match. InvalidArgument for a
  // bad name, help, label name or boundaries; AlreadyExists when the name is
  // taken by a different family, or a histogram's _bucket/_sum/_count name
  // collides with another family's.
  template <typename T>
  absl::StatusOr<Family<T>*> Register(FamilyOptions options) {
    absl::MutexLock lock(&mu_);
    FamilyBase* existing = nullptr;
    if (absl::Status s = CheckLocked(options, &existing); !s.ok()) return s;
    if (existing != nullptr) return static_cast<Family<T>*>(existing);
    auto family = std::unique_ptr<Family<T>>(new Family<T>(std::move(options)));
    Family<T>* raw = family.get();
    families_.emplace(raw->name(), std::move(family));
    return raw;
  }

  // A family that is never exported, handed out when registration failed.
  template <typename T>
  Family<T>& Detach(FamilyOptions options) {
    auto detached =
        std::unique_ptr<Family<T>>(new Family<T>(std::move(options)));
    Family<T>& ref = *detached;
    absl::MutexLock lock(&mu_);
    detached_.push_back(std::move(detached));
    return ref;
  }

  // Validates `options` (normalising its buckets) and looks for a family of
  // the same name, set in `*existing` when compatible.
  absl::Status CheckLocked(FamilyOptions& options, FamilyBase** existing) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void LogDropped(const absl::Status& status);

  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<FamilyBase>> families_
      ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<FamilyBase>> detached_ ABSL_GUARDED_BY(mu_);
};

// Collects a family's name, help, label names (and histogram buckets), then
// registers it. Cheap to copy; not thread-safe itself.
template <typename T>
class Builder {
 public:
  Builder() { options_.type = T::kType; }

  Builder& Name(absl::string_view name) {
    options_.name = std::string(name);
    return *this;
  }
  Builder& Help(absl::string_view help) {
    options_.help = std::string(help);
    return *this;
  }
  // The label names every series of the family must carry.
  Builder& Labels(std::vector<std::string> label_names) {
    options_.label_names = std::move(label_names);
    return *this;
  }
  // Name, help and labels from a spec (see metric_names.h); registering
  // fails if the spec's type is not T's.
  Builder& Spec(const MetricSpec& spec) {
    spec_type_ = spec.type;
    options_.name = std::string(spec.name);
    options_.help = std::string(spec.help);
    options_.label_names = spec.LabelNames();
    return *this;
  }
  // Histograms: finite upper bounds, strictly increasing (+Inf is implied).
  template <typename U = T,
            std::enable_if_t<std::is_same_v<U, Histogram>, int> = 0>
  Builder& Buckets(Histogram::BucketBoundaries boundaries) {
    options_.buckets = std::move(boundaries);
    return *this;
  }

  // Errors as Registry::Register, plus InvalidArgument for a Spec of
  // another type.
  absl::StatusOr<Family<T>*> TryRegister(Registry& registry) const {
    if (absl::Status s = CheckSpecType(); !s.ok()) return s;
    return registry.Register<T>(options_);
  }

  // As TryRegister, but on error logs it and returns a family that accepts
  // every call and is never exported; meant for start-up code with constant
  // names, which a test of that code should cover via TryRegister.
  Family<T>& Register(Registry& registry) const {
    absl::StatusOr<Family<T>*> family = TryRegister(registry);
    if (family.ok()) return **family;
    Registry::LogDropped(family.status());
    return registry.Detach<T>(options_);
  }

 private:
  absl::Status CheckSpecType() const {
    if (spec_type_.has_value() && *spec_type_ != T::kType) {
      return absl::InvalidArgumentError(absl::StrCat(
          options_.name, ": spec says ", MetricTypeName(*spec_type_),
          " but built as ", MetricTypeName(T::kType)));
    }
    return absl::OkStatus();
  }

  FamilyOptions options_;
  std::optional<MetricType> spec_type_;
};

inline Builder<Counter> BuildCounter() { return {}; }
inline Builder<Gauge> BuildGauge() { return {}; }
inline Builder<Histogram> BuildHistogram() { return {}; }

}  // namespace zeroshard::metrics
