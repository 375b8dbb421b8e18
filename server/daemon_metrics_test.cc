// /metrics of a daemon that has run a small job: valid exposition (promtool
// check metrics, no lint), and values equal to the ledger and the traffic the
// RPCs carried.

#include "server/metrics/daemon_metrics.h"

#include <map>
#include <set>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "metrics/metric_names.h"
#include "metrics/promtool_testutil.h"
#include "metrics/registry.h"
#include "prometheus/registry.h"
#include "server/activation/activation_metrics.h"
#include "server/daemon.h"
#include "server/ledger/memory_ledger.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using metrics::testing::Fetch;
using testing::DaemonClient;
using testing::GradientChunks;
using testing::MakeSpec;
using testing::SampleLayout;

// Sample lines "name{labels} value" -> value.
std::map<std::string, double> ParseSamples(const std::string& text) {
  std::map<std::string, double> out;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    double v = 0;
    if (absl::SimpleAtod(line.substr(space + 1), &v)) out[std::string(line.substr(0, space))] = v;
  }
  return out;
}

TEST(DaemonMetrics, ExportsValidMetricsEqualToTheLedger) {
  DaemonOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "127.0.0.1:0";
  options.memory_limit_bytes = 1 << 30;
  options.read_lease = absl::ZeroDuration();
  auto daemon = Daemon::Start(options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_GT((*daemon)->metrics_port(), 0);
  DaemonClient client((*daemon)->address());
  v1::JobSpec spec = MakeSpec("m1", SampleLayout(), 3, 2, {(*daemon)->address()});
  spec.set_precision(v1::DTYPE_BF16);
  const JobConfig config = *ParseJobSpec(spec);
  ASSERT_TRUE(client.Register(spec, 0).ok());
  ASSERT_TRUE(client.Join(spec, 0).ok());
  ASSERT_TRUE(client.Join(spec, 1).ok());
  const uint64_t n = config.map.total_elements();
  std::vector<float> g(n, 0.5f);
  uint64_t pushed = 0;
  for (uint32_t r = 0; r < 2; ++r) {
    auto chunks = GradientChunks("m1", 1, r, config.map, {0, n}, g.data(), 700);
    for (const auto& c : chunks) pushed += c.data().size();
    ASSERT_TRUE(client.Push(chunks).ok());
  }
  v1::PrepareStepResponse p;
  ASSERT_TRUE(client.Prepare("m1", 1, &p).ok());
  ASSERT_TRUE(client.Commit("m1", 1, 0.01f).ok());
  std::vector<float> params;
  ASSERT_TRUE(client.Gather("m1", 1, {0, n}, &params, 1000, v1::DTYPE_BF16).ok());
  EXPECT_FALSE(client.Commit("m1", 9, 0.01f).ok());  // one FAILED_PRECONDITION

  const auto response = Fetch((*daemon)->metrics_port(), "GET", "/metrics");
  ASSERT_EQ(response.status, 200);
  const std::string promtool = metrics::testing::FindPromtool();
  if (!promtool.empty()) {
    const auto check = metrics::testing::RunPromtool(promtool, "check metrics", response.body);
    EXPECT_EQ(check.exit_code, 0) << check.output;
    EXPECT_EQ(check.output, "") << check.output;
  }
  const absl::Status contract = metrics::CheckExportsContract((*daemon)->registry().Collect());
  EXPECT_TRUE(contract.ok()) << contract;
  auto samples = ParseSamples(response.body);
  const CategoryBytes ledger = (*daemon)->ledger().JobBytes("m1");
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    const std::string key =
        absl::StrCat("zeroshard_memory_bytes{category=\"",
                     MemoryCategoryName(static_cast<MemoryCategory>(c)), "\",job=\"m1\"}");
    if (ledger[c] == 0 && samples.count(key) == 0) continue;
    ASSERT_EQ(samples.count(key), 1u) << key << "\n" << response.body;
    EXPECT_EQ(samples[key], static_cast<double>(ledger[c])) << key;
  }
  EXPECT_GT(samples["zeroshard_memory_bytes{category=\"param_master\",job=\"m1\"}"], 0);
  EXPECT_EQ(samples["zeroshard_memory_limit_bytes"], 1 << 30);
  EXPECT_EQ(samples["zeroshard_jobs"], 1);
  EXPECT_EQ(samples["zeroshard_ranks_connected{job=\"m1\"}"], 2);
  EXPECT_EQ(samples["zeroshard_world_size{job=\"m1\"}"], 2);
  EXPECT_EQ(samples["zeroshard_comm_bytes_total{job=\"m1\",op=\"push\",transport=\"stream\"}"],
            static_cast<double>(pushed));
  EXPECT_EQ(samples["zeroshard_comm_bytes_total{job=\"m1\",op=\"gather\",transport=\"stream\"}"],
            static_cast<double>(n * 2));
  EXPECT_EQ(samples["zeroshard_requests_total{code=\"OK\",rpc=\"PushGradient\"}"], 2);
  EXPECT_EQ(samples["zeroshard_requests_total{code=\"FAILED_PRECONDITION\",rpc=\"CommitStep\"}"],
            1);
  EXPECT_EQ(samples["zeroshard_optimizer_seconds_count{job=\"m1\"}"], 1);
  EXPECT_GT(samples["zeroshard_optimizer_params_per_second"], 0);
  EXPECT_EQ(samples["zeroshard_build_info{version=\"dev\"}"], 1);

  // Every rank leaves: the job's series go away.
  for (uint32_t r = 0; r < 2; ++r) {
    grpc::ClientContext ctx;
    v1::LeaveRequest req;
    req.set_incarnation(testing::kTestIncarnation);
    req.set_job_id("m1");
    req.set_rank(r);
    v1::LeaveResponse resp;
    ASSERT_TRUE(client.control->Leave(&ctx, req, &resp).ok());
  }
  (*daemon)->jobs().Tick();  // the read lease (0 here) has ended: reaped
  const auto after = Fetch((*daemon)->metrics_port(), "GET", "/metrics");
  EXPECT_EQ(after.body.find("job=\"m1\""), std::string::npos) << after.body;
  EXPECT_NE(after.body.find("zeroshard_jobs 0"), std::string::npos) << after.body;
}

// The families with a series labelled job="`job`".
std::set<std::string> FamiliesOfJob(const prometheus::Registry& registry, const std::string& job) {
  std::set<std::string> out;
  for (const prometheus::MetricFamily& f : registry.Collect()) {
    for (const prometheus::ClientMetric& m : f.metric) {
      for (const prometheus::ClientMetric::Label& l : m.label) {
        if (l.name == "job" && l.value == job) out.insert(f.name);
      }
    }
  }
  return out;
}

// Every family of the contract with a job label gets that job's series from
// DaemonMetrics or ActivationMetrics, and their RemoveJob leaves none of them
// (prometheus-cpp cannot remove by label; each family must be listed).
TEST(DaemonMetrics, RemoveJobRemovesEverySeriesOfTheJob) {
  std::set<std::string> job_families;
  for (const metrics::MetricSpec& spec : metrics::kAllMetrics) {
    for (const std::string& label : spec.LabelNames()) {
      if (label == "job") job_families.insert(std::string(spec.name));
    }
  }
  prometheus::Registry registry;
  MemoryLedger ledger(0);
  DaemonMetrics daemon_metrics(&registry, &ledger, "dev");
  ActivationMetrics activation_metrics(&registry);
  for (const std::string job : {"a", "b"}) {
    ASSERT_TRUE(ledger.Reserve(job, MemoryCategory::kGrad, 100).ok());
    daemon_metrics.RecordTraffic(job, "push", "stream", 10);
    daemon_metrics.RecordCommit(job, absl::Milliseconds(2), 100);
    daemon_metrics.RecordCommit(job, absl::Milliseconds(2), 100);  // the second times a step
    daemon_metrics.RecordCheckpointSnapshot(job, absl::Milliseconds(1), 0);
    daemon_metrics.RecordCheckpointWrite(job, absl::Milliseconds(3), 1000);
    daemon_metrics.SetCheckpointComplete(job, 1);
    daemon_metrics.SetRanks(job, 1, 2);
    daemon_metrics.RecordNodeCache(job, 1, 1, 4096);
    daemon_metrics.SetStateDisk(job, 1 << 20);
    activation_metrics.RecordHit(job);
    activation_metrics.RecordMiss(job);
    activation_metrics.RecordSpill(job, 4096);
    activation_metrics.RecordFetch(job, absl::Microseconds(80));
  }
  daemon_metrics.RecordRequest("Join", absl::OkStatus());
  EXPECT_EQ(FamiliesOfJob(registry, "a"), job_families);
  const absl::Status contract = metrics::CheckExportsContract(registry.Collect());
  EXPECT_TRUE(contract.ok()) << contract;

  daemon_metrics.RemoveJob("a");
  activation_metrics.RemoveJob("a");
  EXPECT_EQ(FamiliesOfJob(registry, "a"), std::set<std::string>());
  EXPECT_EQ(FamiliesOfJob(registry, "b"), job_families);
  EXPECT_EQ(metrics::SumOf(registry.Collect(), metrics::kRequestsTotal.name), 1);
}

}  // namespace
}  // namespace zeroshard
