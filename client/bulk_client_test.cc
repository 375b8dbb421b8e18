// zeroshard::Client over each bulk transport ("inproc", "grpc", and "ucx"
// over tcp and over shared memory) against in-process daemons serving it: a
// few training steps, 2 daemons, 2-3 ranks, stages 1-3, give parameters
// bit-identical to the same run over the streaming RPCs ("stream"); traffic
// is counted per operation as over the streams. UCX cases skip when UCX
// cannot initialise for the requested UCX_TLS.

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/testing/training_data.h"
#include "gtest/gtest.h"
#include "metrics/metric_names.h"
#include "metrics/registry.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using testing::ComputeGradient;
using testing::InitialParams;

struct BulkCase {
  const char* transport;
  const char* tls;  // UCX_TLS for "ucx"
  uint32_t stage;
  uint32_t world;
  DType precision;
};

// One step: stages 1-2 gather all and push all; stage 3 gathers layer by
// layer (forward, then backward, pushing each layer's gradient).
absl::Status TrainStep(Client& client, uint64_t step, std::vector<float>* params) {
  const Layout& layout = client.layout();
  const uint32_t rank = client.config().rank;
  const bool fp32 = client.config().precision == DType::kFp32;
  std::vector<float> grad(layout.total_elements());
  if (client.config().stage < 3) {
    if (absl::Status s = client.GatherAll(params->data(), DType::kFp32); !s.ok()) return s;
    ComputeGradient(params->data(), 0, grad.size(), rank, step, grad.data());
    absl::StatusOr<PushTicket> t = client.PushGradients({0, grad.size()}, grad.data(), DType::kFp32);
    if (!t.ok()) return t.status();
  } else {
    if (!fp32) return absl::InvalidArgumentError("the stage-3 case runs in fp32");
    for (int pass = 0; pass < 2; ++pass) {
      std::vector<uint32_t> layers = layout.layers();
      if (pass == 1) std::reverse(layers.begin(), layers.end());
      for (uint32_t layer : layers) {
        const FlatRange r = *layout.LayerRange(layer);
        if (absl::Status s = client.Gather(layer, params->data() + r.begin); !s.ok()) return s;
        if (pass == 1) {
          ComputeGradient(params->data() + r.begin, r.begin, r.end, rank, step,
                          grad.data() + r.begin);
          absl::StatusOr<PushTicket> t =
              client.PushGradients(r, grad.data() + r.begin, DType::kFp32);
          if (!t.ok()) return t.status();
        }
      }
    }
  }
  absl::StatusOr<StepResult> r = client.Step(0.01f);
  return r.status();
}

struct RunResult {
  bool skipped = false;
  std::string why;
  std::vector<float> fp32;         // rank 0's parameters after the run
  std::vector<uint16_t> half;      // the same in the job's half precision
  TrafficBytes last_step;          // rank 0's
  double bulk_push_bytes = 0;      // what the daemons counted as pushed in bulk
  double pulled_bytes = 0;         // ... as summed in place from push memory
  // Parameter bytes the ranks received over the run, less what rank 0 has
  // not reported (each other rank reported its rest with its Leave), and
  // what the daemons counted as gathered, once the other ranks had left.
  double client_gathered = 0;
  double daemons_gathered = 0;
};

// Bytes the daemon counted under zeroshard_comm_bytes_total{op="push",
// transport=`transport`}.
double PushBytes(const Daemon& daemon, const std::string& transport_name) {
  return metrics::SumOf(daemon.registry().Collect(), metrics::kCommBytesTotal.name,
                        {{"op", "push"}, {"transport", transport_name}});
}

// ... {op="gather"}, over every transport.
double GatherBytes(const Daemon& daemon) {
  return metrics::SumOf(daemon.registry().Collect(), metrics::kCommBytesTotal.name,
                        {{"op", "gather"}});
}

// `push_memory`: ClientConfig::push_memory (the staging pool in push
// memory, which the daemons, in this process, read in place).
RunResult RunSteps(const BulkCase& c, const std::string& transport, bool push_memory = true) {
  const std::string bulk = c.transport;  // what the daemons serve
  RunResult result;
  const Layout layout = testing::SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  const uint64_t total = layout.total_elements();
  std::vector<std::unique_ptr<Daemon>> daemons;
  std::vector<std::string> addresses;
  for (int i = 0; i < 2; ++i) {
    DaemonOptions o;
    o.bulk_transport = bulk;
    o.ucx_tls = c.tls;
    // Loopback, and every peer is this process: UCX keys may go out over tcp.
    o.ucx_trust_peers = true;
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    if (!d.ok()) {
      ADD_FAILURE() << d.status();
      return result;
    }
    if ((*d)->bulk_transport() == nullptr) {
      result.skipped = true;
      result.why = absl::StrCat("the daemon cannot serve ", bulk, " (UCX_TLS=", c.tls, ")");
      return result;
    }
    addresses.push_back((*d)->address());
    daemons.push_back(*std::move(d));
  }
  std::vector<std::vector<float>> params(c.world, std::vector<float>(total));
  std::atomic<int> skipped{0};
  std::atomic<uint64_t> others_gathered{0};
  std::atomic<uint32_t> others_left{0};
  std::vector<std::thread> threads;
  for (uint32_t rank = 0; rank < c.world; ++rank) {
    threads.emplace_back([&, rank] {
      ClientConfig config;
      config.job_token = testing::kTestToken;
      config.daemons = addresses;
      config.job_id = "bulk";
      config.rank = rank;
      config.world_size = c.world;
      config.stage = c.stage;
      config.precision = c.precision;
      config.bucket_bytes = 4096;
      config.optimizer.lr = 1e-2f;
      config.max_grad_norm = 1.0f;
      config.rpc_timeout = absl::Seconds(10);
      config.step_timeout = absl::Seconds(20);
      config.io_threads = 2;
      config.transport = transport;
      config.ucx_tls = c.tls;
      config.push_memory = push_memory;
      // Rank 0 gathers over one connection per daemon, the others over two.
      config.bulk_progress_threads = rank == 0 ? 1 : 2;
      absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(config);
      if (absl::IsUnavailable(client.status())) return void(++skipped);
      ASSERT_TRUE(client.ok()) << client.status();
      ASSERT_TRUE((*client)->RegisterModel(layout, init.data()).ok());
      for (uint64_t step = 1; step <= 3; ++step) {
        absl::Status s = TrainStep(**client, step, &params[rank]);
        ASSERT_TRUE(s.ok()) << transport << " rank " << rank << " step " << step << ": " << s;
      }
      ASSERT_TRUE((*client)->GatherAll(params[rank].data(), DType::kFp32).ok());
      if (rank != 0) {
        others_gathered += (*client)->TrafficReport().total.gather;
        ASSERT_TRUE((*client)->Leave().ok());
        ++others_left;
        return;
      }
      result.last_step = (*client)->TrafficReport().last_step;
      // Before rank 0 leaves: the daemons drop a job's series with it.
      for (const auto& d : daemons) {
        result.bulk_push_bytes += PushBytes(*d, bulk);
        result.pulled_bytes += PushBytes(*d, "push_memory");
      }
      if (c.precision != DType::kFp32) {
        result.half.resize(total);
        ASSERT_TRUE((*client)->GatherAll(result.half.data(), c.precision).ok());
      }
      // The daemons' gather count with every other rank gone (the job
      // and its series stay until rank 0 leaves).
      for (int i = 0; i < 2000 && others_left + skipped < c.world - 1; ++i) {
        absl::SleepFor(absl::Milliseconds(10));
      }
      ASSERT_EQ(others_left + skipped, c.world - 1);
      const ClientTrafficReport t = (*client)->TrafficReport();
      result.client_gathered =
          static_cast<double>(others_gathered + t.total.gather - t.unreported_gather);
      for (const auto& d : daemons) result.daemons_gathered += GatherBytes(*d);
      ASSERT_TRUE((*client)->Leave().ok());
    });
  }
  for (auto& t : threads) t.join();
  if (skipped > 0) {
    result.skipped = true;
    result.why = absl::StrCat("the client's ", bulk, " transport cannot initialise (UCX_TLS=",
                              c.tls, ")");
    return result;
  }
  for (uint32_t r = 1; r < c.world; ++r) EXPECT_EQ(params[r], params[0]) << "rank " << r;
  result.fp32 = params[0];
  return result;
}

class BulkClientTest : public ::testing::TestWithParam<BulkCase> {};

TEST_P(BulkClientTest, ParametersAreBitIdenticalToStream) {
  const BulkCase& c = GetParam();
  // Buckets Put into the daemons' staging slots, and summed in place from
  // the clients' push memory.
  RunResult put = RunSteps(c, c.transport, /*push_memory=*/false);
  if (put.skipped) GTEST_SKIP() << put.why;
  ASSERT_FALSE(HasFailure());
  RunResult pulled = RunSteps(c, c.transport, /*push_memory=*/true);
  ASSERT_FALSE(HasFailure());
  RunResult stream = RunSteps(c, "stream");
  ASSERT_FALSE(HasFailure());
  for (const RunResult* bulk : {&put, &pulled}) {
    ASSERT_EQ(bulk->fp32.size(), stream.fp32.size());
    EXPECT_EQ(0, std::memcmp(bulk->fp32.data(), stream.fp32.data(), bulk->fp32.size() * 4));
    EXPECT_EQ(bulk->half, stream.half);
    // Per-operation traffic is the same whichever transport carried it.
    EXPECT_EQ(bulk->last_step.push, stream.last_step.push);
    EXPECT_EQ(bulk->last_step.gather, stream.last_step.gather);
    EXPECT_GT(bulk->last_step.push, 0u);
  }
  // The pushes really went where asked (not over the streams), and only
  // there: the daemon labels streamed pushes "stream", put ones with the
  // bulk transport, pulled ones "push_memory".
  EXPECT_GT(put.bulk_push_bytes, 0);
  EXPECT_EQ(put.pulled_bytes, 0);
  EXPECT_GT(pulled.pulled_bytes, 0);
  EXPECT_EQ(pulled.bulk_push_bytes, 0);
  EXPECT_EQ(stream.bulk_push_bytes + stream.pulled_bytes, 0);
  // The daemons counted every parameter byte the ranks read, those read
  // under a read lease without asking included (reported later).
  for (const RunResult* r : {&put, &pulled, &stream}) {
    EXPECT_GT(r->client_gathered, 0);
    EXPECT_EQ(r->daemons_gathered, r->client_gathered);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Runs, BulkClientTest,
    ::testing::Values(BulkCase{"inproc", "", 1, 2, DType::kFp32},
                      BulkCase{"inproc", "", 2, 3, DType::kBf16},
                      BulkCase{"inproc", "", 3, 2, DType::kFp32},
                      BulkCase{"grpc", "", 2, 2, DType::kBf16},
                      BulkCase{"grpc", "", 3, 3, DType::kFp32},
                      BulkCase{"ucx", "tcp", 1, 2, DType::kFp32},
                      BulkCase{"ucx", "tcp", 2, 3, DType::kBf16},
                      BulkCase{"ucx", "tcp", 3, 3, DType::kFp32},
                      BulkCase{"ucx", "posix,cma,self", 1, 3, DType::kBf16},
                      BulkCase{"ucx", "posix,cma,self", 2, 2, DType::kFp32},
                      BulkCase{"ucx", "posix,cma,self", 3, 2, DType::kFp32}),
    [](const ::testing::TestParamInfo<BulkCase>& info) {
      const std::string t = info.param.transport;
      std::string name = t == "ucx" ? (info.param.tls[0] == 't' ? "UcxTcp" : "UcxShm")
                                    : (t == "grpc" ? "Grpc" : "Inproc");
      return absl::StrCat(name, "_Stage", info.param.stage, "_World", info.param.world,
                          info.param.precision == DType::kFp32 ? "_Fp32" : "_Bf16");
    });

}  // namespace
}  // namespace zeroshard
