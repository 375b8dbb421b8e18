#include "metrics/registry.h"

#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "metrics/metric_spec.h"

namespace zeroshard::metrics {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

std::vector<std::string> FamilyNames(const Registry& registry) {
  std::vector<std::string> names;
  for (const MetricFamily& f : registry.Collect()) names.push_back(f.name);
  return names;
}

TEST(RegistryTest, AddReturnsTheSameSeriesForTheSameLabels) {
  Registry registry;
  Family<Counter>& family = BuildCounter()
                                .Name("zs_ops_total")
                                .Help("Ops.")
                                .Labels({"job", "op"})
                                .Register(registry);
  Counter& a = family.Add({{"job", "a"}, {"op", "push"}});
  Counter& b = family.Add({{"op", "push"}, {"job", "a"}});
  Counter& c = family.Add({{"job", "a"}, {"op", "pull"}});
  EXPECT_EQ(&a, &b);
  EXPECT_NE(&a, &c);
  a.Increment();
  b.Increment(2.5);
  EXPECT_DOUBLE_EQ(a.Value(), 3.5);
  EXPECT_EQ(family.size(), 2u);
  EXPECT_TRUE(family.Has({{"job", "a"}, {"op", "pull"}}));
  EXPECT_FALSE(family.Has({{"job", "b"}, {"op", "pull"}}));
}

TEST(RegistryTest, CounterIgnoresNegativeAndNaN) {
  Counter counter;
  counter.Increment(5);
  counter.Increment(-1);
  counter.Increment(NAN);
  EXPECT_EQ(counter.Value(), 5);
}

TEST(RegistryTest, GaugeSetIncrementDecrement) {
  Gauge gauge;
  gauge.Set(10);
  gauge.Increment();
  gauge.Increment(4);
  gauge.Decrement(20);
  gauge.Decrement();
  EXPECT_EQ(gauge.Value(), -6);
  gauge.SetToCurrentTime();
  EXPECT_GT(gauge.Value(), 1.5e9);  // After 2017.
}

TEST(RegistryTest, HistogramBucketsUseLessOrEqual) {
  Histogram histogram({0.5, 1, 2.5});
  for (double v : {0.25, 0.5, 0.75, 1.0, 4.0}) histogram.Observe(v);
  histogram.Observe(NAN);
  const ClientMetric m = histogram.Collect();
  ASSERT_EQ(m.buckets.size(), 4u);
  EXPECT_EQ(m.buckets[0].upper_bound, 0.5);
  EXPECT_EQ(m.buckets[0].cumulative_count, 2u);
  EXPECT_EQ(m.buckets[1].cumulative_count, 4u);
  EXPECT_EQ(m.buckets[2].cumulative_count, 4u);
  EXPECT_TRUE(std::isinf(m.buckets[3].upper_bound));
  EXPECT_EQ(m.buckets[3].cumulative_count, 6u);
  EXPECT_EQ(m.sample_count, 6u);
  EXPECT_TRUE(std::isnan(m.sample_sum));
}

TEST(RegistryTest, HistogramFamilyBucketsAndPerSeriesBuckets) {
  Registry registry;
  Family<Histogram>& family = BuildHistogram()
                                  .Name("zs_step_seconds")
                                  .Help("Step time.")
                                  .Labels({"job"})
                                  .Buckets({0.1, 1, INFINITY})
                                  .Register(registry);
  EXPECT_THAT(family.buckets(), ElementsAre(0.1, 1));
  Histogram& a = family.Add({{"job", "a"}});
  EXPECT_THAT(a.boundaries(), ElementsAre(0.1, 1));
  Histogram& b = family.Add({{"job", "b"}}, {1, 2, 3});
  EXPECT_THAT(b.boundaries(), ElementsAre(1, 2, 3));
  // Same labels, same bounds: the same series.
  EXPECT_EQ(*family.TryAdd({{"job", "b"}}, {1, 2, 3}), &b);
  EXPECT_EQ(family.TryAdd({{"job", "b"}}, {1, 2}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(family.TryAdd({{"job", "c"}}, {2, 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ValidationTest, MetricNames) {
  for (const char* good :
       {"a", "_a", ":a", "zeroshard_memory_bytes", "a:b_1"}) {
    EXPECT_TRUE(ValidateMetricName(good).ok()) << good;
  }
  for (const char* bad : {"", "1a", "a-b", "a b", "a.b", "é"}) {
    EXPECT_EQ(ValidateMetricName(bad).code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(ValidationTest, LabelNames) {
  for (const char* good : {"a", "_a", "job", "a_1", "_"}) {
    EXPECT_TRUE(ValidateLabelName(good).ok()) << good;
  }
  for (const char* bad : {"", "1a", "a:b", "a-b", "__name__", "__x"}) {
    EXPECT_EQ(ValidateLabelName(bad).code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(ValidationTest, LabelValuesMustBeUtf8) {
  EXPECT_TRUE(ValidateLabelValue("").ok());
  EXPECT_TRUE(ValidateLabelValue("job \"é\" \xF0\x9F\x98\x80\n\\").ok());
  for (const char* bad :
       {"\xFF", "a\xC3", "\xC0\xAF", "\xED\xA0\x80", "\xF4\x90\x80\x80"}) {
    EXPECT_EQ(ValidateLabelValue(bad).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(ValidationTest, BucketBoundaries) {
  EXPECT_TRUE(ValidateBucketBoundaries({}).ok());
  EXPECT_TRUE(ValidateBucketBoundaries({-1, 0, 1, INFINITY}).ok());
  for (const std::vector<double>& bad : std::vector<std::vector<double>>{
           {1, 1}, {2, 1}, {NAN}, {-INFINITY, 0}, {INFINITY, 1}}) {
    EXPECT_EQ(ValidateBucketBoundaries(bad).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(RegistryTest, RegistrationErrorsAreInvalidArgument) {
  Registry registry;
  EXPECT_EQ(BuildCounter()
                .Name("bad-name")
                .Help("h")
                .TryRegister(registry)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      BuildCounter().Name("zs_total").TryRegister(registry).status().code(),
      absl::StatusCode::kInvalidArgument);  // No help.
  EXPECT_EQ(BuildCounter()
                .Name("zs_total")
                .Help("h")
                .Labels({"__job"})
                .TryRegister(registry)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildCounter()
                .Name("zs_total")
                .Help("h")
                .Labels({"job", "job"})
                .TryRegister(registry)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildHistogram()
                .Name("zs_seconds")
                .Help("h")
                .Labels({"le"})
                .TryRegister(registry)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildHistogram()
                .Name("zs_seconds")
                .Help("h")
                .Buckets({1, 0.5})
                .TryRegister(registry)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  constexpr MetricSpec kGaugeSpec = {"zs_gauge", MetricType::kGauge, "h", {}};
  EXPECT_EQ(
      BuildCounter().Spec(kGaugeSpec).TryRegister(registry).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(FamilyNames(registry), IsEmpty());
}

TEST(RegistryTest, ReRegistration) {
  Registry registry;
  absl::StatusOr<Family<Gauge>*> first = BuildGauge()
                                             .Name("zs_memory_bytes")
                                             .Help("Memory.")
                                             .Labels({"job", "category"})
                                             .TryRegister(registry);
  ASSERT_TRUE(first.ok()) << first.status();
  // Same type and label names (any order): the same family.
  absl::StatusOr<Family<Gauge>*> again = BuildGauge()
                                             .Name("zs_memory_bytes")
                                             .Help("Memory.")
                                             .Labels({"category", "job"})
                                             .TryRegister(registry);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*first, *again);

  absl::StatusOr<Family<Counter>*> other_type =
      BuildCounter().Name("zs_memory_bytes").Help("x").TryRegister(registry);
  EXPECT_EQ(other_type.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(other_type.status().message(), HasSubstr("gauge"));

  EXPECT_EQ(BuildGauge()
                .Name("zs_memory_bytes")
                .Help("x")
                .Labels({"job"})
                .TryRegister(registry)
                .status()
                .code(),
            absl::StatusCode::kAlreadyExists);

  ASSERT_TRUE(BuildHistogram()
                  .Name("zs_step_seconds")
                  .Help("h")
                  .Buckets({1})
                  .TryRegister(registry)
                  .ok());
  EXPECT_EQ(BuildHistogram()
                .Name("zs_step_seconds")
                .Help("h")
                .Buckets({2})
                .TryRegister(registry)
                .status()
                .code(),
            absl::StatusCode::kAlreadyExists);
  // A gauge whose name is one of the histogram's sample names.
  EXPECT_EQ(BuildGauge()
                .Name("zs_step_seconds_count")
                .Help("h")
                .TryRegister(registry)
                .status()
                .code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(
      BuildGauge().Name("zs_x_sum").Help("h").TryRegister(registry).ok());
  EXPECT_EQ(BuildHistogram()
                .Name("zs_x")
                .Help("h")
                .TryRegister(registry)
                .status()
                .code(),
            absl::StatusCode::kAlreadyExists);
}

TEST(RegistryTest, InvalidLabelsAreRejectedWithoutCrashing) {
  Registry registry;
  Family<Counter>& family = BuildCounter()
                                .Name("zs_ops_total")
                                .Help("Ops.")
                                .Labels({"job", "op"})
                                .Register(registry);
  for (const Labels& bad :
       std::vector<Labels>{{{"job", "a"}},
                           {{"job", "a"}, {"op", "push"}, {"extra", "x"}},
                           {{"job", "a"}, {"kind", "push"}},
                           {{"job", "\xFF"}, {"op", "push"}}}) {
    absl::StatusOr<Counter*> counter = family.TryAdd(bad);
    EXPECT_EQ(counter.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(counter.status().message(), HasSubstr("zs_ops_total"));
    // The reference API hands out a metric that is never exported.
    family.Add(bad).Increment();
  }
  EXPECT_EQ(family.size(), 0u);
  EXPECT_THAT(FamilyNames(registry), IsEmpty());
}

TEST(RegistryTest, FailedRegisterReturnsAnUnexportedFamily) {
  Registry registry;
  Family<Gauge>& bad =
      BuildGauge().Name("0bad").Help("h").Labels({"job"}).Register(registry);
  bad.Add({{"job", "a"}}).Set(1);
  Family<Counter>& clash =
      BuildCounter().Name("0bad").Help("h").Register(registry);
  clash.Add({}).Increment();
  EXPECT_THAT(FamilyNames(registry), IsEmpty());
}

TEST(RegistryTest, CollectOrdersFamiliesAndSeriesAndSkipsEmptyFamilies) {
  Registry registry;
  auto& b =
      BuildGauge().Name("zs_b").Help("b").Labels({"job"}).Register(registry);
  BuildGauge().Name("zs_empty").Help("e").Register(registry);
  auto& a = BuildGauge().Name("zs_a").Help("a").Register(registry);
  b.Add({{"job", "y"}}).Set(2);
  b.Add({{"job", "x"}}).Set(1);
  a.Add({}).Set(3);
  const std::vector<MetricFamily> families = registry.Collect();
  ASSERT_EQ(families.size(), 2u);
  EXPECT_EQ(families[0].name, "zs_a");
  EXPECT_EQ(families[0].help, "a");
  EXPECT_EQ(families[0].type, MetricType::kGauge);
  EXPECT_EQ(families[1].name, "zs_b");
  ASSERT_EQ(families[1].metrics.size(), 2u);
  EXPECT_EQ(families[1].metrics[0].labels.at("job"), "x");
  EXPECT_EQ(families[1].metrics[0].value, 1);
  EXPECT_EQ(families[1].metrics[1].labels.at("job"), "y");
}

TEST(RegistryTest, RemoveSeries) {
  Registry registry;
  auto& memory = BuildGauge()
                     .Name("zs_memory_bytes")
                     .Help("m")
                     .Labels({"job", "category"})
                     .Register(registry);
  auto& comm = BuildCounter()
                   .Name("zs_comm_bytes_total")
                   .Help("c")
                   .Labels({"job"})
                   .Register(registry);
  auto& jobs = BuildGauge().Name("zs_jobs").Help("j").Register(registry);
  Gauge& a_grad = memory.Add({{"job", "a"}, {"category", "grad"}});
  memory.Add({{"job", "a"}, {"category", "buffer"}}).Set(1);
  memory.Add({{"job", "b"}, {"category", "grad"}}).Set(1);
  comm.Add({{"job", "a"}}).Increment(10);
  comm.Add({{"job", "b"}}).Increment(10);
  jobs.Add({}).Set(2);

  memory.Remove(&a_grad);
  EXPECT_FALSE(memory.Has({{"job", "a"}, {"category", "grad"}}));
  EXPECT_EQ(memory.size(), 2u);
  memory.Remove(nullptr);  // Ignored.
  Gauge foreign;
  memory.Remove(&foreign);  // Ignored.
  EXPECT_EQ(memory.size(), 2u);

  EXPECT_EQ(memory.RemoveIf("category", "buffer"), 1u);
  EXPECT_EQ(memory.RemoveIf("no_such_label", "b"), 0u);

  // Job b leaves: every series it had goes, other families untouched.
  EXPECT_EQ(registry.RemoveIf("job", "b"), 2u);
  EXPECT_EQ(memory.size(), 0u);
  EXPECT_EQ(comm.size(), 1u);
  EXPECT_TRUE(comm.Has({{"job", "a"}}));
  EXPECT_EQ(jobs.size(), 1u);

  // A removed series starts again from zero when re-added.
  EXPECT_EQ(memory.Add({{"job", "b"}, {"category", "grad"}}).Value(), 0);
}

TEST(RegistryConcurrencyTest, ConcurrentIncrementsAreExact) {
  constexpr int kThreads = 4;
  constexpr int kIterations = 100000;
  Registry registry;
  auto& counters = BuildCounter()
                       .Name("zs_ops_total")
                       .Help("o")
                       .Labels({"job"})
                       .Register(registry);
  auto& gauges = BuildGauge()
                     .Name("zs_level")
                     .Help("l")
                     .Labels({"job"})
                     .Register(registry);
  auto& histograms = BuildHistogram()
                         .Name("zs_op_seconds")
                         .Help("h")
                         .Labels({"job"})
                         .Buckets({0.5, 1.5})
                         .Register(registry);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      // Every thread looks its series up itself, racing the first Add.
      Counter& counter = counters.Add({{"job", "a"}});
      Gauge& gauge = gauges.Add({{"job", "a"}});
      Histogram& histogram = histograms.Add({{"job", "a"}});
      for (int i = 0; i < kIterations; ++i) {
        counter.Increment();
        gauge.Increment(2);
        gauge.Decrement();
        histogram.Observe(i % 2 == 0 ? 0.25 : 1.0);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(counters.Add({{"job", "a"}}).Value(), kThreads * kIterations);
  EXPECT_EQ(gauges.Add({{"job", "a"}}).Value(), kThreads * kIterations);
  const ClientMetric h = histograms.Add({{"job", "a"}}).Collect();
  EXPECT_EQ(h.sample_count, static_cast<uint64_t>(kThreads) * kIterations);
  EXPECT_EQ(h.buckets[0].cumulative_count, h.sample_count / 2);
  EXPECT_EQ(h.buckets.back().cumulative_count, h.sample_count);
  EXPECT_EQ(h.sample_sum, kThreads * kIterations / 2 * 1.25);
}

TEST(RegistryConcurrencyTest, CollectWhileSeriesComeAndGo) {
  Registry registry;
  auto& histograms = BuildHistogram()
                         .Name("zs_op_seconds")
                         .Help("h")
                         .Labels({"job"})
                         .Buckets({1, 2})
                         .Register(registry);
  auto& counters = BuildCounter()
                       .Name("zs_ops_total")
                       .Help("o")
                       .Labels({"job"})
                       .Register(registry);
  std::atomic<bool> done{false};
  std::thread churn([&] {
    for (int i = 0; i < 2000; ++i) {
      const Labels labels = {{"job", absl::StrCat("j", i % 7)}};
      Histogram& h = histograms.Add(labels);
      h.Observe(i % 3);
      counters.Add(labels).Increment();
      if (i % 5 == 0) registry.RemoveIf("job", labels.at("job"));
    }
    done = true;
  });
  int collections = 0;
  while (!done || collections == 0) {
    for (const MetricFamily& family : registry.Collect()) {
      for (const ClientMetric& m : family.metrics) {
        if (family.type != MetricType::kHistogram) continue;
        ASSERT_EQ(m.buckets.size(), 3u);
        EXPECT_LE(m.buckets[0].cumulative_count, m.buckets[1].cumulative_count);
        EXPECT_LE(m.buckets[1].cumulative_count, m.buckets[2].cumulative_count);
        EXPECT_EQ(m.buckets[2].cumulative_count, m.sample_count);
      }
    }
    ++collections;
  }
  churn.join();
  EXPECT_GT(collections, 0);
}

}  // namespace
}  // namespace zeroshard::metrics
