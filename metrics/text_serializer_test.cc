#include "metrics/text_serializer.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>

#include "gtest/gtest.h"
#include "metrics/registry.h"

namespace zeroshard::metrics {
namespace {

std::string Render(const Registry& registry) {
  return TextSerializer().Serialize(registry.Collect());
}

TEST(FormatDoubleTest, SpecialValuesAndShortestForm) {
  EXPECT_EQ(FormatDouble(0), "0");
  EXPECT_EQ(FormatDouble(1024), "1024");
  EXPECT_EQ(FormatDouble(-2.5), "-2.5");
  EXPECT_EQ(FormatDouble(0.1), "0.1");
  EXPECT_EQ(FormatDouble(1e6), "1e+06");
  EXPECT_EQ(FormatDouble(1.5e-7), "1.5e-07");
  EXPECT_EQ(FormatDouble(INFINITY), "+Inf");
  EXPECT_EQ(FormatDouble(-INFINITY), "-Inf");
  EXPECT_EQ(FormatDouble(NAN), "NaN");
}

TEST(FormatDoubleTest, RoundTrips) {
  std::mt19937_64 rng(42);
  std::uniform_int_distribution<uint64_t> bits;
  int checked = 0;
  while (checked < 10000) {
    const uint64_t b = bits(rng);
    double v;
    static_assert(sizeof(v) == sizeof(b));
    std::memcpy(&v, &b, sizeof(v));
    if (!std::isfinite(v)) continue;
    const std::string text = FormatDouble(v);
    EXPECT_EQ(std::strtod(text.c_str(), nullptr), v) << text;
    ++checked;
  }
  for (double v :
       {std::numeric_limits<double>::max(), std::numeric_limits<double>::min(),
        std::numeric_limits<double>::denorm_min(), 0.1 + 0.2,
        9007199254740993.0}) {
    EXPECT_EQ(std::strtod(FormatDouble(v).c_str(), nullptr), v);
  }
}

TEST(EscapeTest, HelpAndLabelValues) {
  EXPECT_EQ(EscapeHelp("a\\b\n\"c\""), "a\\\\b\\n\"c\"");
  EXPECT_EQ(EscapeLabelValue("a\\b\n\"c\""), "a\\\\b\\n\\\"c\\\"");
}

TEST(TextSerializerTest, EmptyRegistryIsEmpty) {
  Registry registry;
  BuildGauge().Name("zs_unused").Help("Never set.").Register(registry);
  EXPECT_EQ(Render(registry), "");
}

TEST(TextSerializerTest, CountersAndGaugesGolden) {
  Registry registry;
  auto& comm = BuildCounter()
                   .Name("zs_comm_bytes_total")
                   .Help("Bytes moved.\nBy op; see \\docs.")
                   .Labels({"job", "op"})
                   .Register(registry);
  auto& limit = BuildGauge()
                    .Name("zs_memory_limit_bytes")
                    .Help("Limit.")
                    .Register(registry);
  auto& odd = BuildGauge()
                  .Name("zs_odd")
                  .Help("Odd values.")
                  .Labels({"v"})
                  .Register(registry);
  comm.Add({{"op", "push"}, {"job", "a\"quoted\" \\ and\nnewline"}})
      .Increment(1e6);
  comm.Add({{"op", "pull"}, {"job", "a"}}).Increment(4096);
  comm.Add({{"op", "push"}, {"job", "a"}}).Increment(0.5);
  limit.Add({}).Set(64.0 * (1 << 30));
  odd.Add({{"v", "inf"}}).Set(INFINITY);
  odd.Add({{"v", "nan"}}).Set(NAN);
  odd.Add({{"v", "neg_inf"}}).Set(-INFINITY);
  odd.Add({{"v", "small"}}).Set(-1.25e-9);
  odd.Add({{"v", "\xC3\xA9t\xC3\xA9"}}).Set(3);

  EXPECT_EQ(Render(registry),
            R"(# HELP zs_comm_bytes_total Bytes moved.\nBy op; see \\docs.
# TYPE zs_comm_bytes_total counter
zs_comm_bytes_total{job="a",op="pull"} 4096
zs_comm_bytes_total{job="a",op="push"} 0.5
zs_comm_bytes_total{job="a\"quoted\" \\ and\nnewline",op="push"} 1e+06
# HELP zs_memory_limit_bytes Limit.
# TYPE zs_memory_limit_bytes gauge
zs_memory_limit_bytes 68719476736
# HELP zs_odd Odd values.
# TYPE zs_odd gauge
zs_odd{v="inf"} +Inf
zs_odd{v="nan"} NaN
zs_odd{v="neg_inf"} -Inf
zs_odd{v="small"} -1.25e-09
zs_odd{v="été"} 3
)");
}

TEST(TextSerializerTest, HistogramsGolden) {
  Registry registry;
  auto& step = BuildHistogram()
                   .Name("zs_step_seconds")
                   .Help("Step time.")
                   .Labels({"job"})
                   .Buckets({0.5, 1, 2.5})
                   .Register(registry);
  auto& plain = BuildHistogram()
                    .Name("zs_plain_seconds")
                    .Help("No labels, no finite buckets.")
                    .Register(registry);
  Histogram& a = step.Add({{"job", "a"}});
  for (double v : {0.25, 0.5, 0.75, 4.0}) a.Observe(v);
  step.Add({{"job", "b"}});  // No observations yet.
  plain.Add({}).Observe(2);

  EXPECT_EQ(Render(registry),
            R"(# HELP zs_plain_seconds No labels, no finite buckets.
# TYPE zs_plain_seconds histogram
zs_plain_seconds_bucket{le="+Inf"} 1
zs_plain_seconds_sum 2
zs_plain_seconds_count 1
# HELP zs_step_seconds Step time.
# TYPE zs_step_seconds histogram
zs_step_seconds_bucket{job="a",le="0.5"} 2
zs_step_seconds_bucket{job="a",le="1"} 3
zs_step_seconds_bucket{job="a",le="2.5"} 3
zs_step_seconds_bucket{job="a",le="+Inf"} 4
zs_step_seconds_sum{job="a"} 5.5
zs_step_seconds_count{job="a"} 4
zs_step_seconds_bucket{job="b",le="0.5"} 0
zs_step_seconds_bucket{job="b",le="1"} 0
zs_step_seconds_bucket{job="b",le="2.5"} 0
zs_step_seconds_bucket{job="b",le="+Inf"} 0
zs_step_seconds_sum{job="b"} 0
zs_step_seconds_count{job="b"} 0
)");
}

TEST(TextSerializerTest, OutputIsDeterministic) {
  Registry registry;
  auto& g =
      BuildGauge().Name("zs_g").Help("g").Labels({"b", "a"}).Register(registry);
  for (const char* v : {"3", "1", "2"}) g.Add({{"b", v}, {"a", "x"}}).Set(1);
  const std::string first = Render(registry);
  EXPECT_EQ(first, Render(registry));
  EXPECT_EQ(first,
            "# HELP zs_g g\n# TYPE zs_g gauge\n"
            "zs_g{a=\"x\",b=\"1\"} 1\nzs_g{a=\"x\",b=\"2\"} 1\n"
            "zs_g{a=\"x\",b=\"3\"} 1\n");
}

}  // namespace
}  // namespace zeroshard::metrics
