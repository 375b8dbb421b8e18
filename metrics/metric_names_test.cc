#include "metrics/metric_names.h"

#include <iterator>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "metrics/promtool_testutil.h"
#include "metrics/registry.h"
#include "prometheus/check_names.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace zeroshard::metrics {
namespace {

TEST(MetricNamesTest, NamesAndLabelsAreValidAndSorted) {
  std::string previous;
  for (const MetricSpec& spec : kAllMetrics) {
    EXPECT_TRUE(prometheus::CheckMetricName(std::string(spec.name))) << spec.name;
    EXPECT_TRUE(absl::StartsWith(spec.name, "zeroshard_")) << spec.name;
    EXPECT_LT(previous, spec.name) << "kAllMetrics out of order or duplicated";
    previous = std::string(spec.name);
    // prometheus-cpp writes help text as it is: no escapes, so no `\` and
    // no newline.
    EXPECT_FALSE(spec.help.empty()) << spec.name;
    EXPECT_FALSE(absl::StrContains(spec.help, "\\") || absl::StrContains(spec.help, "\n"))
        << spec.name;
    std::set<std::string> labels;
    for (const std::string& label : spec.LabelNames()) {
      EXPECT_TRUE(prometheus::CheckLabelName(label)) << spec.name << " " << label;
      EXPECT_TRUE(labels.insert(label).second) << spec.name << " " << label;
    }
    if (spec.type == MetricType::kHistogram) {
      EXPECT_EQ(labels.count("le"), 0u) << spec.name;
    }
    EXPECT_EQ(FindMetric(spec.name), &spec);
  }
  EXPECT_EQ(FindMetric("zeroshard_nope"), nullptr);
}

TEST(MetricNamesTest, NamesFollowTheConventions) {
  for (const MetricSpec& spec : kAllMetrics) {
    const bool total = absl::EndsWith(spec.name, "_total");
    EXPECT_EQ(total, spec.type == MetricType::kCounter) << spec.name;
    if (spec.type == MetricType::kHistogram) {
      EXPECT_TRUE(absl::EndsWith(spec.name, "_seconds")) << spec.name;
    }
    if (absl::StrContains(spec.name, "bytes")) {
      EXPECT_TRUE(absl::EndsWith(spec.name, "_bytes") ||
                  absl::EndsWith(spec.name, "_bytes_total"))
          << spec.name;
    }
  }
}

TEST(MetricNamesTest, MemoryCategoriesAreTheLedgers) {
  std::set<absl::string_view> categories(std::begin(kMemoryCategories),
                                         std::end(kMemoryCategories));
  EXPECT_EQ(categories.size(), 10u);
  EXPECT_EQ(categories.count("fragmentation"), 1u);
  EXPECT_EQ(categories.count("replica"), 1u);
  EXPECT_EQ(categories.count("param_cache"), 1u);
}

// Every family registers, and a registry holding all of them exports what
// the contract says and passes `promtool check metrics` (syntax and lint)
// with no complaint.
template <const MetricSpec&... specs>
void RegisterAndUse(prometheus::Registry& registry) {
  const auto use = [](auto& family, const MetricSpec& spec) {
    prometheus::Labels labels;
    for (const std::string& name : spec.LabelNames()) {
      labels[name] = absl::StrCat(name, "-value");
    }
    using Family = std::remove_reference_t<decltype(family)>;
    if constexpr (std::is_same_v<Family, prometheus::Family<prometheus::Counter>>) {
      family.Add(labels).Increment(3);
    } else if constexpr (std::is_same_v<Family, prometheus::Family<prometheus::Gauge>>) {
      family.Add(labels).Set(1);
    } else {
      family.Add(labels, LatencySecondsBuckets()).Observe(0.2);
    }
  };
  (use(Register<specs>(registry), specs), ...);
}

TEST(MetricNamesTest, AllFamiliesExportCleanly) {
  prometheus::Registry registry;
  RegisterAndUse<kActivationFetchSeconds, kActivationHitsTotal, kActivationMissesTotal,
                 kActivationSpillBytesTotal, kActivationSpillsTotal, kBuildInfo,
                 kCheckpointBytesTotal, kCheckpointLastCompleteStep,
                 kCheckpointLastCompleteTimestamp, kCheckpointSeconds, kCommBytesTotal, kJobs,
                 kMemoryBytes, kMemoryLimitBytes, kNodeCacheFetchBytesTotal,
                 kNodeCacheFetchesTotal, kNodeCacheHitsTotal, kOptimizerParamsPerSecond,
                 kOptimizerSeconds,
                 kRanksConnected, kRequestsTotal, kStateDiskBytes, kStepSeconds,
                 kWorldSize>(registry);
  const std::vector<prometheus::MetricFamily> families = registry.Collect();
  ASSERT_EQ(families.size(), std::size(kAllMetrics));
  EXPECT_TRUE(CheckExportsContract(families).ok()) << CheckExportsContract(families);
  const std::string text = prometheus::TextSerializer().Serialize(families);

  const std::string promtool = testing::FindPromtool();
  if (promtool.empty()) {
    GTEST_SKIP() << "promtool not found on PATH or in /usr/bin";
  }
  const testing::CommandResult lint =
      testing::RunPromtool(promtool, "check metrics", text);
  EXPECT_EQ(lint.exit_code, 0) << lint.output;
  EXPECT_EQ(lint.output, "") << text;
}

}  // namespace
}  // namespace zeroshard::metrics
