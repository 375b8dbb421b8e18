#include "metrics/registry.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "metrics/metric_names.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace zeroshard::metrics {
namespace {

TEST(RegistryTest, RegisterUsesTheSpecAndReturnsTheSameFamilyTwice) {
  prometheus::Registry registry;
  prometheus::Family<prometheus::Counter>& first = Register<kRequestsTotal>(registry);
  EXPECT_EQ(&Register<kRequestsTotal>(registry), &first);
  first.Add({{"rpc", "Join"}, {"code", "OK"}}).Increment(2);
  const std::vector<prometheus::MetricFamily> families = registry.Collect();
  ASSERT_EQ(families.size(), 1u);
  EXPECT_EQ(families[0].name, kRequestsTotal.name);
  EXPECT_EQ(families[0].help, kRequestsTotal.help);
  EXPECT_EQ(families[0].type, prometheus::MetricType::Counter);
}

TEST(RegistryTest, HistogramsKeepTheirBucketBounds) {
  prometheus::Registry registry;
  Register<kStepSeconds>(registry).Add({{"job", "a"}}, LatencySecondsBuckets()).Observe(0.001);
  const std::vector<prometheus::MetricFamily> families = registry.Collect();
  ASSERT_EQ(families.size(), 1u);
  ASSERT_EQ(families[0].metric.size(), 1u);
  const auto& buckets = families[0].metric[0].histogram.bucket;
  ASSERT_EQ(buckets.size(), LatencySecondsBuckets().size() + 1);  // and +Inf
  for (size_t i = 0; i < LatencySecondsBuckets().size(); ++i) {
    EXPECT_EQ(buckets[i].upper_bound, LatencySecondsBuckets()[i]);
    EXPECT_EQ(buckets[i].cumulative_count, 1u) << i;  // le: 0.001 <= 0.001
  }
  const std::string text = prometheus::TextSerializer().Serialize(families);
  EXPECT_TRUE(absl::StrContains(text, "zeroshard_step_seconds_bucket{job=\"a\",le=\"0.0025\"} 1"))
      << text;
  EXPECT_TRUE(absl::StrContains(text, "zeroshard_step_seconds_bucket{job=\"a\",le=\"+Inf\"} 1"))
      << text;
}

TEST(RegistryTest, RemoveSeriesRemovesOnlyThatLabelValue) {
  prometheus::Registry registry;
  auto& memory = Register<kMemoryBytes>(registry);
  memory.Add({{"job", "a"}, {"category", "grad"}}).Set(1);
  memory.Add({{"job", "a"}, {"category", "optim_m"}}).Set(2);
  memory.Add({{"job", "ab"}, {"category", "grad"}}).Set(3);
  auto& step = Register<kStepSeconds>(registry);
  step.Add({{"job", "a"}}, LatencySecondsBuckets()).Observe(1);
  step.Add({{"job", "b"}}, LatencySecondsBuckets()).Observe(1);

  EXPECT_EQ(RemoveSeries(memory, "job", "a"), 2u);
  EXPECT_EQ(RemoveSeries(step, "job", "a"), 1u);
  EXPECT_EQ(RemoveSeries(memory, "job", "a"), 0u);
  EXPECT_FALSE(memory.Has({{"job", "a"}, {"category", "grad"}}));
  EXPECT_TRUE(memory.Has({{"job", "ab"}, {"category", "grad"}}));
  EXPECT_FALSE(step.Has({{"job", "a"}}));
  EXPECT_TRUE(step.Has({{"job", "b"}}));
}

TEST(RegistryTest, SumOfMatchesLabelSubsets) {
  prometheus::Registry registry;
  auto& comm = Register<kCommBytesTotal>(registry);
  comm.Add({{"job", "a"}, {"op", "push"}, {"transport", "ucx"}}).Increment(10);
  comm.Add({{"job", "b"}, {"op", "push"}, {"transport", "ucx"}}).Increment(20);
  comm.Add({{"job", "a"}, {"op", "gather"}, {"transport", "ucx"}}).Increment(40);
  Register<kJobs>(registry).Add({}).Set(2);
  const std::vector<prometheus::MetricFamily> families = registry.Collect();
  EXPECT_EQ(SumOf(families, kCommBytesTotal.name), 70);
  EXPECT_EQ(SumOf(families, kCommBytesTotal.name, {{"op", "push"}, {"transport", "ucx"}}), 30);
  EXPECT_EQ(SumOf(families, kCommBytesTotal.name, {{"job", "a"}, {"op", "gather"}}), 40);
  EXPECT_EQ(SumOf(families, kCommBytesTotal.name, {{"op", "init"}}), 0);
  EXPECT_EQ(SumOf(families, kJobs.name), 2);
  EXPECT_EQ(SumOf(families, "zeroshard_nope"), 0);
}

TEST(RegistryTest, CheckExportsContractNamesWhatDiffers) {
  prometheus::Registry registry;
  Register<kMemoryBytes>(registry).Add({{"job", "a"}, {"category", "grad"}}).Set(1);
  EXPECT_TRUE(CheckExportsContract(registry.Collect()).ok());

  // A series without one of the spec's labels.
  Register<kMemoryBytes>(registry).Add({{"job", "a"}}).Set(1);
  absl::Status s = CheckExportsContract(registry.Collect());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "zeroshard_memory_bytes")) << s;

  prometheus::Registry other;
  prometheus::BuildGauge().Name("zeroshard_other").Help("x").Register(other).Add({}).Set(1);
  s = CheckExportsContract(other.Collect());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "zeroshard_other")) << s;

  prometheus::Registry retyped;
  prometheus::BuildCounter()
      .Name(std::string(kJobs.name))
      .Help(std::string(kJobs.help))
      .Register(retyped)
      .Add({})
      .Increment();
  EXPECT_EQ(CheckExportsContract(retyped.Collect()).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zeroshard::metrics
