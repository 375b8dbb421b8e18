// zeroshard::Client against in-process daemons on loopback, over the
// streaming RPCs and over the "inproc" bulk transport (no UCX needed): the
// traffic the paper promises per step (2Ψ in stages 1-2, 3Ψ in stage 3),
// C_B-bounded staging memory, the push cut rule, stage-3 layer buffers, the
// step's retry contract, liveness, and the errors a trainer sees when its
// input is wrong or a daemon goes away.

#include "client/client.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/data_path.h"
#include "client/testing/training_data.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {

// Reaches into a Client for tests: swaps a data path before RegisterModel.
class ClientTestPeer {
 public:
  static void WrapDataPath(
      Client& client, size_t daemon,
      const std::function<std::unique_ptr<DataPath>(std::unique_ptr<DataPath>)>& wrap) {
    client.data_paths_[daemon] = wrap(std::move(client.data_paths_[daemon]));
  }
};

namespace {

using testing::ComputeGradient;
using testing::InitialParams;

using testing::DaemonClient;
using testing::SampleLayout;

// Daemons serving both the streaming RPCs and the "inproc" bulk transport.
std::unique_ptr<Daemon> StartDaemon(absl::Duration rank_timeout = absl::Seconds(30),
                                    absl::Duration reduction_hold = absl::ZeroDuration()) {
  DaemonOptions o;
  o.bulk_transport = "inproc";
  o.rank_timeout = rank_timeout;
  o.reduction_hold = reduction_hold;
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

struct Daemons {
  explicit Daemons(int n) {
    for (int i = 0; i < n; ++i) {
      daemons.push_back(StartDaemon());
      addresses.push_back(daemons.back()->address());
    }
  }
  std::vector<std::unique_ptr<Daemon>> daemons;
  std::vector<std::string> addresses;
};

// Whether the daemon at `address` still has job `job`.
bool HasJob(const std::string& address, const std::string& job) {
  v1::StepState state;
  return DaemonClient(address).StepState(job, &state).error_code() != grpc::StatusCode::NOT_FOUND;
}

ClientConfig MakeConfig(const std::string& job, const std::vector<std::string>& daemons,
                        uint32_t rank, uint32_t world, uint32_t stage,
                        const std::string& transport = "stream") {
  ClientConfig c;
  c.job_token = testing::kTestToken;
  c.daemons = daemons;
  c.job_id = job;
  c.rank = rank;
  c.world_size = world;
  c.stage = stage;
  c.precision = DType::kFp32;
  c.bucket_bytes = 4096;
  c.optimizer.lr = 1e-2f;
  c.optimizer.weight_decay = 0.01f;
  c.max_grad_norm = 1.0f;
  c.rpc_timeout = absl::Seconds(10);
  c.step_timeout = absl::Seconds(20);
  c.io_threads = 2;
  c.transport = transport;
  return c;
}

// Runs fn(rank) on one thread per rank; returns when all are done.
void RunRanks(uint32_t world, const std::function<void(uint32_t)>& fn) {
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < world; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

std::unique_ptr<Client> Connect(const ClientConfig& config, const Layout& layout,
                                const float* init) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(config);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return nullptr;
  const absl::Status s = (*client)->RegisterModel(layout, init);
  EXPECT_TRUE(s.ok()) << s;
  return s.ok() ? *std::move(client) : nullptr;
}

// One training step of one rank: stages 1-2 gather everything and push the
// whole gradient; stage 3 gathers layer by layer forward, again backward,
// and pushes each layer's gradient after its backward gather.
absl::StatusOr<StepResult> TrainStep(Client& client, uint64_t step, float lr,
                                     std::vector<float>* params) {
  const Layout& layout = client.layout();
  const uint32_t rank = client.config().rank;
  std::vector<float> grad(layout.total_elements());
  if (client.config().stage < 3) {
    if (absl::Status s = client.GatherAll(params->data(), DType::kFp32); !s.ok()) return s;
    ComputeGradient(params->data(), 0, grad.size(), rank, step, grad.data());
    absl::StatusOr<PushTicket> t =
        client.PushGradients({0, grad.size()}, grad.data(), DType::kFp32);
    if (!t.ok()) return t.status();
  } else {
    for (uint32_t layer : layout.layers()) {
      const FlatRange r = *layout.LayerRange(layer);
      if (absl::Status s = client.Gather(layer, params->data() + r.begin); !s.ok()) return s;
    }
    std::vector<PushTicket> tickets;
    for (auto it = layout.layers().rbegin(); it != layout.layers().rend(); ++it) {
      const FlatRange r = *layout.LayerRange(*it);
      std::vector<float> layer(r.size());
      if (absl::Status s = client.Gather(*it, layer.data()); !s.ok()) return s;
      if (std::memcmp(layer.data(), params->data() + r.begin, r.size() * 4) != 0) {
        return absl::InternalError("backward gather differs from forward gather");
      }
      ComputeGradient(layer.data(), r.begin, r.end, rank, step, grad.data() + r.begin);
      absl::StatusOr<PushTicket> t =
          client.PushGradients(r, grad.data() + r.begin, DType::kFp32);
      if (!t.ok()) return t.status();
      tickets.push_back(*t);
    }
  }
  return client.Step(lr);
}

// ---- Traffic: 2Ψ per rank per step in stages 1-2, 3Ψ in stage 3 ----

struct TrafficCase {
  uint32_t world;
  uint32_t stage;
  const char* transport;
};

class TrafficTest : public ::testing::TestWithParam<TrafficCase> {};

TEST_P(TrafficTest, BytesPerRankPerStepMatchThePaper) {
  const uint32_t world = GetParam().world, stage = GetParam().stage;
  const std::string transport = GetParam().transport;
  Daemons daemons(2);
  const Layout layout = SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  const uint64_t psi = layout.parameter_count();
  const uint64_t total = layout.total_elements();
  const std::string job = absl::StrCat("traffic-", world, "-", stage, "-", transport);
  constexpr int kSteps = 3;
  std::vector<std::vector<ClientTrafficReport>> reports(world);
  std::vector<std::vector<StepResult>> results(world);
  std::atomic<int> failures{0};
  RunRanks(world, [&](uint32_t rank) {
    ClientConfig config = MakeConfig(job, daemons.addresses, rank, world, stage, transport);
    std::unique_ptr<Client> client = Connect(config, layout, init.data());
    if (client == nullptr) {
      ++failures;
      return;
    }
    std::vector<float> params(total);
    for (int step = 1; step <= kSteps; ++step) {
      absl::StatusOr<StepResult> r = TrainStep(*client, step, 0.01f, &params);
      if (!r.ok()) {
        ADD_FAILURE() << "rank " << rank << " step " << step << ": " << r.status();
        ++failures;
        return;
      }
      results[rank].push_back(*r);
      reports[rank].push_back(client->TrafficReport());
    }
    EXPECT_TRUE(client->Leave().ok());
  });
  ASSERT_EQ(failures.load(), 0);
  const uint64_t factor = stage == 3 ? 3 : 2;
  const uint64_t expected = factor * total * 4;
  const uint64_t paper = factor * psi * 4;
  for (uint32_t rank = 0; rank < world; ++rank) {
    for (int s = 0; s < kSteps; ++s) {
      const TrafficBytes& b = reports[rank][s].last_step;
      EXPECT_EQ(b.push, total * 4) << "rank " << rank << " step " << s + 1;
      EXPECT_EQ(b.gather, (factor - 1) * total * 4) << "rank " << rank << " step " << s + 1;
      EXPECT_EQ(b.init, 0u);
      EXPECT_EQ(b.total(), expected);
      // Within the alignment padding of the paper's figure.
      EXPECT_LE(b.total() - paper, factor * (total - psi) * 4);
    }
    EXPECT_EQ(reports[rank].back().total.init, rank == 0 ? total * 4 : 0);
    EXPECT_EQ(results[rank].back().step, static_cast<uint64_t>(kSteps));
    // Every rank learns the leader's norm and clip coefficient, bit for bit.
    for (int s = 0; s < kSteps; ++s) {
      ASSERT_TRUE(results[rank][s].have_norm);
      EXPECT_EQ(results[rank][s].grad_norm, results[0][s].grad_norm);
      EXPECT_EQ(results[rank][s].clip_coef, results[0][s].clip_coef);
      EXPECT_EQ(results[rank][s].loss_scale, 1.0f);
      EXPECT_FALSE(results[rank][s].skipped);
    }
  }
  if (stage == 3) {
    EXPECT_GT(reports[0].back().prefetch_hits, 0u);
  }
  std::printf("N_d=%u stage %u: measured %llu B per rank per step (push %llu + gather %llu); "
              "%llu·Ψ·4 = %llu B; alignment padding %llu elements\n",
              world, stage, static_cast<unsigned long long>(reports[0].back().last_step.total()),
              static_cast<unsigned long long>(reports[0].back().last_step.push),
              static_cast<unsigned long long>(reports[0].back().last_step.gather),
              static_cast<unsigned long long>(factor), static_cast<unsigned long long>(paper),
              static_cast<unsigned long long>(total - psi));
  for (const std::string& a : daemons.addresses) EXPECT_FALSE(HasJob(a, job));
}

INSTANTIATE_TEST_SUITE_P(
    WorldAndStage, TrafficTest,
    ::testing::Values(TrafficCase{2, 1, "stream"}, TrafficCase{2, 2, "stream"},
                      TrafficCase{2, 3, "stream"}, TrafficCase{3, 1, "inproc"},
                      TrafficCase{3, 2, "inproc"}, TrafficCase{3, 3, "inproc"},
                      TrafficCase{4, 1, "stream"}, TrafficCase{4, 2, "inproc"},
                      TrafficCase{4, 3, "stream"}),
    [](const ::testing::TestParamInfo<TrafficCase>& info) {
      return absl::StrCat("Nd", info.param.world, "Stage", info.param.stage, "_",
                          info.param.transport);
    });

// ---- The node cache: the host daemon serves the other daemons' ranges ----

// Both daemons on loopback: every rank finds daemon 0 its host's daemon.
// Training with the node cache ends with the parameters of training
// without it, bit for bit, and daemon 1 serves a step's gathers once to
// daemon 0 instead of once per rank and gather.
TEST(ClientTest, TheNodeCacheTrainsBitIdenticallyReadingOtherDaemonsOncePerStep) {
  for (const char* transport : {"stream", "inproc"}) {
    Daemons daemons(2);
    const Layout layout = SampleLayout();
    const std::vector<float> init = InitialParams(layout);
    constexpr uint32_t kWorld = 3;
    constexpr int kSteps = 3;
    std::map<bool, std::vector<float>> final_params;
    std::map<bool, double> owner_gathers;
    for (bool cached : {false, true}) {
      const std::string job = absl::StrCat("node-cache-", transport, cached ? "-on" : "-off");
      const double before = testing::RequestCount(*daemons.daemons[1], "Gather");
      std::atomic<int> failures{0};
      RunRanks(kWorld, [&](uint32_t rank) {
        ClientConfig config = MakeConfig(job, daemons.addresses, rank, kWorld, 3, transport);
        config.node_cache = cached;
        std::unique_ptr<Client> client = Connect(config, layout, init.data());
        if (client == nullptr) {
          ++failures;
          return;
        }
        std::vector<float> params(layout.total_elements());
        for (int step = 1; step <= kSteps; ++step) {
          absl::StatusOr<StepResult> r = TrainStep(*client, step, 0.01f, &params);
          if (!r.ok()) {
            ADD_FAILURE() << transport << " rank " << rank << " step " << step << ": "
                          << r.status();
            ++failures;
            return;
          }
        }
        if (rank == 0) {
          final_params[cached].resize(layout.total_elements());
          EXPECT_TRUE(client->GatherAll(final_params[cached].data(), DType::kFp32).ok());
          if (cached) {
            EXPECT_GT(daemons.daemons[0]->ledger().JobBytes(job)[static_cast<int>(
                          MemoryCategory::kParamCache)],
                      0u);
          }
        }
        EXPECT_TRUE(client->Leave().ok());
      });
      ASSERT_EQ(failures.load(), 0) << transport;
      owner_gathers[cached] = testing::RequestCount(*daemons.daemons[1], "Gather") - before;
    }
    EXPECT_EQ(final_params[true], final_params[false]) << transport;
    // Without the cache each rank reads daemon 1 for each of its layers
    // (stream) or waits on it per request (bulk); with it daemon 0 reads
    // daemon 1 once per step, and the last GatherAll once more at most.
    EXPECT_LE(owner_gathers[true], kSteps + 2) << transport;
    EXPECT_GT(owner_gathers[false], owner_gathers[true] * 2) << transport;
    std::printf("%s: Gather calls daemon 1 answered: %.0f without the node cache, %.0f with it\n",
                transport, owner_gathers[false], owner_gathers[true]);
  }
}

// ---- The cut rule: any split of the pushes works across ranks ----

TEST(ClientTest, RanksMaySplitTheirPushesDifferently) {
  Daemons daemons(2);
  const Layout layout = SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  std::vector<std::vector<float>> gathered(2);
  std::atomic<int> failures{0};
  RunRanks(2, [&](uint32_t rank) {
    std::unique_ptr<Client> client =
        Connect(MakeConfig("split", daemons.addresses, rank, 2, 2), layout, init.data());
    if (client == nullptr) return void(++failures);
    const uint64_t total = layout.total_elements();
    std::vector<float> grad(total, 0.25f);
    if (rank == 0) {  // one call, in bf16
      std::vector<uint16_t> half(total);
      for (uint64_t i = 0; i < total; ++i) half[i] = FloatToBf16(grad[i]);
      if (!client->PushGradients({0, total}, half.data(), DType::kBf16).ok()) ++failures;
    } else {  // tensor by tensor, last first
      for (auto it = layout.tensors().rbegin(); it != layout.tensors().rend(); ++it) {
        if (!client->PushGradients(it->range(), grad.data() + it->offset, DType::kFp32).ok()) {
          ++failures;
        }
      }
    }
    absl::StatusOr<StepResult> r = client->Step(0.01f);
    if (!r.ok()) {
      ADD_FAILURE() << r.status();
      return void(++failures);
    }
    gathered[rank].resize(total);
    if (!client->GatherAll(gathered[rank].data(), DType::kFp32).ok()) ++failures;
  });
  ASSERT_EQ(failures.load(), 0);
  EXPECT_EQ(gathered[0], gathered[1]);
  EXPECT_NE(gathered[0], init);
}

// ---- Stage 3 layer buffers ----

TEST(ClientTest, Stage3ViewsPrefetchAndRelease) {
  Daemons daemons(1);
  const Layout layout = SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  ClientConfig config = MakeConfig("views", daemons.addresses, 0, 1, 3);
  config.prefetch_depth = 1;
  config.layer_buffers = 3;
  std::unique_ptr<Client> client = Connect(config, layout, init.data());
  ASSERT_NE(client, nullptr);
  const auto& layers = layout.layers();
  uint64_t largest = 0;
  for (uint32_t l : layers) largest = std::max(largest, layout.LayerRange(l)->size());
  EXPECT_EQ(client->MemoryReport().param, 3 * largest * 4);
  EXPECT_EQ(client->MemoryReport().param_half, 0u);

  // Forward: each view equals the initial parameters; release all but the last.
  for (uint32_t l : layers) {
    absl::StatusOr<const void*> view = client->GatherView(l);
    ASSERT_TRUE(view.ok()) << view.status();
    const FlatRange r = *layout.LayerRange(l);
    EXPECT_EQ(0, std::memcmp(*view, init.data() + r.begin, r.size() * 4)) << "layer " << l;
    if (l != layers.back()) {
      ASSERT_TRUE(client->Release(l).ok());
    }
  }
  const TrafficBytes forward = client->TrafficReport().current;
  EXPECT_EQ(forward.gather, layout.total_elements() * 4);
  // Backward starts at the held last layer: no traffic for it (only, maybe
  // already, the backward prefetch of the layer before it).
  const uint64_t misses = client->TrafficReport().prefetch_misses;
  ASSERT_TRUE(client->GatherView(layers.back()).ok());
  const uint64_t before_last = layout.LayerRange(layers[layers.size() - 2])->size() * 4;
  EXPECT_LE(client->TrafficReport().current.gather, forward.gather + before_last);
  EXPECT_EQ(client->TrafficReport().prefetch_misses, misses);
  EXPECT_GT(client->TrafficReport().prefetch_hits, 0u);
  // Holding more layers than there are buffers.
  ASSERT_TRUE(client->GatherView(layers[0]).ok());
  ASSERT_TRUE(client->GatherView(layers[1]).ok());
  absl::StatusOr<const void*> over = client->GatherView(layers[2]);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  // Step refuses while views are held.
  std::vector<float> grad(layout.total_elements(), 0.1f);
  ASSERT_TRUE(client->PushGradients({0, grad.size()}, grad.data(), DType::kFp32).ok());
  EXPECT_EQ(client->Step(0.01f).status().code(), absl::StatusCode::kFailedPrecondition);
  for (uint32_t l : layers) ASSERT_TRUE(client->Release(l).ok());
  absl::StatusOr<StepResult> r = client->Step(0.01f);
  ASSERT_TRUE(r.ok()) << r.status();
  // After the step, gathers serve the new parameters.
  std::vector<float> after(layout.total_elements());
  ASSERT_TRUE(client->GatherAll(after.data(), DType::kFp32).ok());
  const FlatRange r0 = *layout.LayerRange(layers[0]);
  std::vector<float> layer0(r0.size());
  ASSERT_TRUE(client->Gather(layers[0], layer0.data()).ok());
  EXPECT_EQ(0, std::memcmp(layer0.data(), after.data() + r0.begin, r0.size() * 4));
  EXPECT_NE(0, std::memcmp(layer0.data(), init.data() + r0.begin, r0.size() * 4));
  EXPECT_EQ(client->GatherView(99).status().code(), absl::StatusCode::kInvalidArgument);
}

// ---- The Collective seam: a trainer collective slots in ----

// Stands in for NCCL: ranks in one process reduce-scatter through shared
// memory (sum in rank order), then each pushes only its own partition, as
// REDUCTION_MODE_TRAINER_COLLECTIVE expects.
class InProcessExchange {
 public:
  explicit InProcessExchange(uint32_t world) : world_(world), grads_(world) {}
  std::vector<float>& grads(uint32_t rank) { return grads_[rank]; }
  // Blocks until every rank has arrived (or the deadline).
  bool Barrier(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    const uint64_t generation = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      return true;
    }
    auto released = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return generation_ != generation; };
    return mu_.AwaitWithDeadline(absl::Condition(&released), deadline);
  }

 private:
  const uint32_t world_;
  std::vector<std::vector<float>> grads_;
  absl::Mutex mu_;
  uint32_t arrived_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
};

class ToyTrainerCollective final : public Collective {
 public:
  explicit ToyTrainerCollective(InProcessExchange* exchange) : exchange_(exchange) {}
  const char* name() const override { return "toy_trainer_collective"; }
  absl::Status Bind(const CollectiveJob& job) override {
    job_ = job;
    exchange_->grads(job.rank).assign(job.layout->total_elements(), 0.0f);
    real_.assign(job.layout->total_elements(), false);
    for (const TensorPlacement& t : job.layout->tensors()) {
      std::fill(real_.begin() + t.offset, real_.begin() + t.offset + t.numel, true);
    }
    return absl::OkStatus();
  }
  absl::StatusOr<PushTicket> Reduce(uint64_t, uint32_t, const FlatRange& range, const void* grads,
                                    DType dtype, BufferUse, MemoryKind, absl::Time) override {
    if (dtype != DType::kFp32) return absl::UnimplementedError("fp32 only");
    std::memcpy(exchange_->grads(job_.rank).data() + range.begin, grads, range.size() * 4);
    return PushTicket();
  }
  bool carries_no_grad_marks() const override { return false; }
  absl::Status MarkNoGradient(uint64_t, uint32_t, absl::Span<const uint32_t> tensors) override {
    return tensors.empty() ? absl::OkStatus() : absl::FailedPreconditionError("no marks");
  }
  absl::Status Finish(uint64_t step, absl::Time deadline) override {
    if (!exchange_->Barrier(deadline)) return absl::DeadlineExceededError("reduce-scatter");
    const FlatRange mine = job_.map->UnpaddedPartition(job_.rank);
    std::vector<float> sum(mine.size());
    for (uint64_t i = mine.begin; i < mine.end; ++i) {
      if (!real_[i]) continue;  // alignment gaps carry zeros, as in daemon reduce
      float acc = exchange_->grads(0)[i];
      for (uint32_t r = 1; r < job_.world_size; ++r) acc += exchange_->grads(r)[i];
      sum[i - mine.begin] = acc;
    }
    if (!exchange_->Barrier(deadline)) return absl::DeadlineExceededError("reduce-scatter");
    GradientPush push{job_.job_id, step,  job_.rank,   job_.incarnation,
                      0,           1,     mine,        DType::kFp32,
                      sum.data()};
    absl::StatusOr<uint64_t> sent =
        job_.daemons[job_.map->DaemonOf(job_.rank)]->PushGradient(push, deadline);
    if (!sent.ok()) return sent.status();
    job_.traffic->AddPush(*sent);
    return absl::OkStatus();
  }
  uint64_t staging_bytes() const override { return 0; }

 private:
  InProcessExchange* exchange_;
  CollectiveJob job_;
  std::vector<bool> real_;
};

TEST(ClientTest, ATrainerCollectiveSlotsInAndMatchesDaemonReduce) {
  const Layout layout = SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  const uint64_t total = layout.total_elements();
  std::vector<std::vector<float>> results;  // [mode]: rank 0's parameters after 3 steps
  std::vector<uint64_t> pushed(2);
  for (ReductionMode mode : {ReductionMode::kDaemon, ReductionMode::kTrainerCollective}) {
    Daemons daemons(1);
    InProcessExchange exchange(2);
    std::vector<std::vector<float>> params(2, std::vector<float>(total));
    std::atomic<int> failures{0};
    RunRanks(2, [&](uint32_t rank) {
      ClientConfig config = MakeConfig("seam", daemons.addresses, rank, 2, 2);
      config.reduction = mode;
      std::unique_ptr<Collective> collective;
      if (mode == ReductionMode::kTrainerCollective) {
        collective = std::make_unique<ToyTrainerCollective>(&exchange);
      }
      absl::StatusOr<std::unique_ptr<Client>> client =
          Client::Create(config, std::move(collective));
      if (!client.ok() || !(*client)->RegisterModel(layout, init.data()).ok()) {
        return void(++failures);
      }
      // A collective that carries no marks says so, and a push with marks is
      // refused before anything is pushed.
      EXPECT_EQ((*client)->carries_no_grad_marks(), mode == ReductionMode::kDaemon);
      if (mode == ReductionMode::kTrainerCollective) {
        const std::vector<float> zeros(total, 0.0f);
        EXPECT_EQ((*client)
                      ->PushGradients({0, total}, zeros.data(), DType::kFp32, 0,
                                      BufferUse::kCopy, MemoryKind::kHost, {0})
                      .status()
                      .code(),
                  absl::StatusCode::kFailedPrecondition);
      }
      for (int step = 1; step <= 3; ++step) {
        absl::StatusOr<StepResult> r = TrainStep(**client, step, 0.01f, &params[rank]);
        if (!r.ok()) {
          ADD_FAILURE() << r.status();
          return void(++failures);
        }
      }
      if (!(*client)->GatherAll(params[rank].data(), DType::kFp32).ok()) ++failures;
      if (rank == 0) {
        pushed[mode == ReductionMode::kDaemon ? 0 : 1] =
            (*client)->TrafficReport().last_step.push;
      }
    });
    ASSERT_EQ(failures.load(), 0);
    EXPECT_EQ(params[0], params[1]);
    results.push_back(params[0]);
  }
  // Same numbers bit for bit; the trainer collective pushes only Ψ/N_d.
  EXPECT_EQ(0, std::memcmp(results[0].data(), results[1].data(), total * 4));
  EXPECT_EQ(pushed[0], total * 4);
  const PartitionMap map = *PartitionMap::Create(total, 2, 1);
  EXPECT_EQ(pushed[1], map.UnpaddedPartition(0).size() * 4);
}

// A ranged GatherAll is the same slice of the whole one, in a bf16 job both
// as the fp32 masters and as the job's bf16 copy: ranges that start past
// 0, cross the daemons' boundary, or lie inside a tensor. Bad ranges are
// refused.
TEST(ClientTest, ARangedGatherIsThatSliceOfTheWholeGather) {
  Daemons daemons(2);
  const Layout layout = SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  const uint64_t total = layout.total_elements();
  ClientConfig config = MakeConfig("ranged", daemons.addresses, 0, 2, 2);
  config.precision = DType::kBf16;
  // Two ranks, so that each daemon owns a partition; rank 0's client reads.
  std::vector<std::unique_ptr<Client>> clients(2);
  std::atomic<int> failures{0};
  RunRanks(2, [&](uint32_t rank) {
    ClientConfig c = config;
    c.rank = rank;
    clients[rank] = Connect(c, layout, init.data());
    if (clients[rank] == nullptr) return void(++failures);
    std::vector<float> params(total);
    for (int step = 1; step <= 2; ++step) {
      absl::StatusOr<StepResult> r = TrainStep(*clients[rank], step, 0.01f, &params);
      if (!r.ok()) {
        ADD_FAILURE() << r.status();
        return void(++failures);
      }
    }
  });
  ASSERT_EQ(failures.load(), 0);
  Client* client = clients[0].get();
  std::vector<float> masters(total);
  ASSERT_TRUE(client->GatherAll(masters.data(), DType::kFp32).ok());
  std::vector<uint16_t> half(total);
  ASSERT_TRUE(client->GatherAll(half.data(), DType::kBf16).ok());
  const uint64_t boundary = client->partition_map().DaemonRange(0).end;
  ASSERT_GT(boundary, 7u);
  ASSERT_LT(boundary + 7, total);
  for (const FlatRange& range : std::vector<FlatRange>{
           {0, total}, {3, total - 5}, {boundary - 7, boundary + 7}, {1, 2}, {boundary, total}}) {
    std::vector<float> fp32(range.size());
    ASSERT_TRUE(client->GatherAll(range, fp32.data(), DType::kFp32).ok())
        << range.begin << ".." << range.end;
    EXPECT_EQ(0, std::memcmp(fp32.data(), masters.data() + range.begin, range.size() * 4))
        << range.begin << ".." << range.end;
    std::vector<uint16_t> bf16(range.size());
    ASSERT_TRUE(client->GatherAll(range, bf16.data(), DType::kBf16).ok());
    EXPECT_EQ(0, std::memcmp(bf16.data(), half.data() + range.begin, range.size() * 2))
        << range.begin << ".." << range.end;
  }
  float x = 0;
  for (const FlatRange& bad : std::vector<FlatRange>{{5, 5}, {0, total + 1}, {total, total + 1}}) {
    EXPECT_EQ(client->GatherAll(bad, &x, DType::kFp32).code(), absl::StatusCode::kInvalidArgument)
        << bad.begin << ".." << bad.end;
  }
  EXPECT_EQ(client->GatherAll({0, 1}, &x, DType::kFp16).code(), absl::StatusCode::kInvalidArgument);
}

// ---- Caller mistakes ----

TEST(ClientTest, BadConfigIsInvalidArgument) {
  const std::vector<std::string> daemons = {"127.0.0.1:7000", "127.0.0.1:7001"};
  struct Case {
    const char* field;
    std::function<void(ClientConfig&)> mutate;
  };
  const std::vector<Case> cases = {
      {"job_id", [](ClientConfig& c) { c.job_id = "has space"; }},
      {"job_id", [](ClientConfig& c) { c.job_id = ""; }},
      {"world_size", [](ClientConfig& c) { c.world_size = 0; }},
      {"rank", [](ClientConfig& c) { c.rank = 4; }},
      {"daemons", [](ClientConfig& c) { c.daemons.clear(); }},
      {"daemons", [](ClientConfig& c) { c.world_size = 1; c.rank = 0; }},
      {"daemons[1]", [](ClientConfig& c) { c.daemons[1] = "no-port"; }},
      {"daemons[1]", [](ClientConfig& c) { c.daemons[1] = c.daemons[0]; }},
      {"stage", [](ClientConfig& c) { c.stage = 0; }},
      {"stage", [](ClientConfig& c) { c.stage = 4; }},
      {"precision", [](ClientConfig& c) { c.precision = static_cast<DType>(9); }},
      {"bucket_bytes", [](ClientConfig& c) { c.bucket_bytes = 100; }},
      {"bucket_bytes", [](ClientConfig& c) { c.bucket_bytes = 2ull << 30; }},
      {"staging_buffers", [](ClientConfig& c) { c.staging_buffers = 1; }},
      {"micro_batches", [](ClientConfig& c) { c.micro_batches = 0; }},
      {"optimizer.lr", [](ClientConfig& c) { c.optimizer.lr = -1; }},
      {"optimizer.beta1", [](ClientConfig& c) { c.optimizer.beta1 = 1.5f; }},
      {"optimizer.beta2", [](ClientConfig& c) { c.optimizer.beta2 = -0.1f; }},
      {"optimizer.eps", [](ClientConfig& c) { c.optimizer.eps = 0; }},
      {"optimizer.weight_decay", [](ClientConfig& c) { c.optimizer.weight_decay = NAN; }},
      {"max_grad_norm", [](ClientConfig& c) { c.max_grad_norm = -1; }},
      {"loss_scale.initial_scale", [](ClientConfig& c) { c.loss_scale.initial_scale = 0; }},
      {"loss_scale.backoff_factor",
       [](ClientConfig& c) { c.loss_scale.dynamic = true; c.loss_scale.backoff_factor = 1; }},
      {"rpc_timeout", [](ClientConfig& c) { c.rpc_timeout = absl::ZeroDuration(); }},
      {"step_timeout", [](ClientConfig& c) { c.step_timeout = absl::InfiniteDuration(); }},
      {"heartbeat_interval",
       [](ClientConfig& c) { c.heartbeat_interval = -absl::Seconds(1); }},
      {"transport", [](ClientConfig& c) { c.transport = "carrier-pigeon"; }},
      {"transport", [](ClientConfig& c) { c.transport = ""; }},
      {"sender_threads", [](ClientConfig& c) { c.sender_threads = 0; }},
      {"io_threads", [](ClientConfig& c) { c.io_threads = 1000; }},
      {"bulk_progress_threads", [](ClientConfig& c) { c.bulk_progress_threads = 0; }},
      {"reduction", [](ClientConfig& c) { c.reduction = static_cast<ReductionMode>(7); }},
      {"optimizer.kind", [](ClientConfig& c) { c.optimizer.kind = static_cast<OptimizerKind>(0); }},
  };
  ASSERT_TRUE(Client::Create(MakeConfig("ok", daemons, 0, 4, 2)).ok());
  for (const Case& c : cases) {
    ClientConfig config = MakeConfig("ok", daemons, 0, 4, 2);
    c.mutate(config);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(config);
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_TRUE(absl::StrContains(client.status().message(), absl::StrCat(c.field, ":")))
        << c.field << ": " << client.status();
  }
  // Every transport name is known (inproc needs no peer to be created).
  for (const char* t : {"stream", "inproc", "grpc"}) {
    absl::StatusOr<std::unique_ptr<Client>> c =
        Client::Create(MakeConfig("ok", daemons, 0, 4, 2, t));
    EXPECT_TRUE(c.ok()) << t << ": " << c.status();
  }
  ClientConfig collective = MakeConfig("ok", daemons, 0, 4, 2);
  collective.reduction = ReductionMode::kTrainerCollective;
  EXPECT_EQ(Client::Create(collective).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ClientTest, BadCallsAreRejectedLocally) {
  Daemons daemons(1);
  const Layout layout = SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  std::unique_ptr<Client> early = *Client::Create(MakeConfig("calls", daemons.addresses, 0, 1, 2));
  float x = 0;
  EXPECT_EQ(early->PushGradients({0, 1}, &x, DType::kFp32).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(early->Step(0.1f).status().code(), absl::StatusCode::kFailedPrecondition);

  std::unique_ptr<Client> client =
      Connect(MakeConfig("calls", daemons.addresses, 0, 1, 2), layout, init.data());
  ASSERT_NE(client, nullptr);
  const uint64_t total = layout.total_elements();
  std::vector<float> grad(total, 0.1f);
  EXPECT_EQ(client->PushGradients({0, total + 1}, grad.data(), DType::kFp32).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->PushGradients({5, 5}, grad.data(), DType::kFp32).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->GatherAll(grad.data(), DType::kBf16).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->Step(-1.0f).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->RegisterModel(layout, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  // Tensors without a gradient: ascending layout indices, each overlapping
  // the range (layer 1 holds l1.w and l1.b, tensors 1 and 2). Refused
  // before anything is pushed.
  const FlatRange l1 = *layout.LayerRange(1);
  for (const std::vector<uint32_t>& bad : std::vector<std::vector<uint32_t>>{
           {2, 1}, {1, 1}, {0}, {3}, {1, 2, 3}, {99}}) {
    const absl::Status s = client
                               ->PushGradients(l1, grad.data(), DType::kFp32, 0, BufferUse::kCopy,
                                               MemoryKind::kHost, bad)
                               .status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "no_grad_tensors[")) << s;
  }
  EXPECT_EQ(client->TrafficReport().total.push, 0u);

  // A step with part of the gradient missing names what is missing.
  const FlatRange big = *layout.LayerRange(2);
  ASSERT_TRUE(client->PushGradients({0, big.begin}, grad.data(), DType::kFp32).ok());
  EXPECT_EQ(client->PushGradients({0, 10}, grad.data(), DType::kFp32).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<StepResult> r = client->Step(0.1f);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "bucket [")) << r.status();
  EXPECT_EQ(client->committed_step(), 0u);
  // Pushing everything again completes the step (buckets that reached the
  // daemon the first time count as delivered).
  ASSERT_TRUE(client->PushGradients({0, total}, grad.data(), DType::kFp32).ok());
  r = client->Step(0.1f);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->step, 1u);
  // What the first attempt delivered was not sent again.
  EXPECT_EQ(client->TrafficReport().total.push, total * 4);
}

// A tensor no rank pushed a gradient for is skipped by the step, as
// torch.optim skips a parameter whose grad is None: its values and its
// update count stay. One rank's gradient for it (zeros included) is enough
// to update it.
TEST(ClientTest, TensorsWithoutAGradientAreSkipped) {
  Daemons daemons(2);
  const Layout layout = SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  const uint64_t total = layout.total_elements();
  const FlatRange l1b = layout.tensors()[2].range();
  std::vector<std::map<uint32_t, uint64_t>> steps(3);
  std::vector<std::vector<float>> params(3, std::vector<float>(total));
  std::atomic<int> failures{0};
  RunRanks(2, [&](uint32_t rank) {
    std::unique_ptr<Client> client =
        Connect(MakeConfig("nograd", daemons.addresses, rank, 2, 2), layout, init.data());
    if (client == nullptr) return void(++failures);
    std::vector<float> grad(total, 0.25f);
    std::fill(grad.begin() + l1b.begin, grad.begin() + l1b.end, 0.0f);
    for (uint64_t step = 1; step <= 2; ++step) {
      // Step 1: no rank has a gradient for l1.b; step 2: rank 1 has.
      const std::vector<uint32_t> no_grad =
          step == 1 || rank == 0 ? std::vector<uint32_t>{2} : std::vector<uint32_t>{};
      absl::StatusOr<PushTicket> t = client->PushGradients(
          {0, total}, grad.data(), DType::kFp32, 0, BufferUse::kCopy, MemoryKind::kHost, no_grad);
      if (!t.ok()) {
        ADD_FAILURE() << t.status();
        return void(++failures);
      }
      absl::StatusOr<StepResult> r = client->Step(0.01f);
      if (!r.ok()) {
        ADD_FAILURE() << r.status();
        return void(++failures);
      }
      if (rank == 0) {
        const absl::Status s = client->ReadState(v1::STATE_ARRAY_MASTER, {0, total},
                                                 params[step].data(), &steps[step]);
        if (!s.ok()) {
          ADD_FAILURE() << s;
          return void(++failures);
        }
      }
    }
  });
  ASSERT_EQ(failures.load(), 0);
  const std::map<uint32_t, uint64_t> after1 = {{0, 1}, {1, 1}, {2, 0}, {3, 1}, {4, 1}, {5, 1}};
  const std::map<uint32_t, uint64_t> after2 = {{0, 2}, {1, 2}, {2, 1}, {3, 2}, {4, 2}, {5, 2}};
  EXPECT_EQ(steps[1], after1);
  EXPECT_EQ(steps[2], after2);
  EXPECT_EQ(std::vector<float>(params[1].begin() + l1b.begin, params[1].begin() + l1b.end),
            std::vector<float>(init.begin() + l1b.begin, init.begin() + l1b.end));
  // Step 2 updated it (weight decay, and its moments start).
  for (uint64_t i = l1b.begin; i < l1b.end; ++i) EXPECT_NE(params[2][i], init[i]) << i;
  // The others moved in step 1.
  const FlatRange embed = layout.tensors()[0].range();
  for (uint64_t i = embed.begin; i < embed.begin + 10; ++i) EXPECT_NE(params[1][i], init[i]) << i;
}

// Without TLS the job token would cross the network in the clear: Create
// refuses a daemon that is not on loopback, naming it and both fixes, until
// the caller opts in (ClientConfig.insecure or ZS_INSECURE=1). It connects
// to nothing, so no daemon needs to be there.
TEST(ClientTest, PlaintextToTheNetworkNeedsInsecure) {
  ::unsetenv("ZS_INSECURE");
  for (const std::string remote : {"10.255.0.1:7070", "[fd00::1]:7070", "node0:7070"}) {
    ClientConfig config = MakeConfig("plain", {"127.0.0.1:7070", remote}, 0, 2, 2);
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(config);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
    EXPECT_TRUE(absl::StrContains(c.status().message(), "ClientConfig.daemons[1]: " + remote))
        << c.status();
    EXPECT_TRUE(absl::StrContains(c.status().message(), "ClientConfig.tls")) << c.status();
    EXPECT_TRUE(absl::StrContains(c.status().message(), "ZS_INSECURE=1")) << c.status();
    config.insecure = true;
    EXPECT_TRUE(Client::Create(config).ok()) << remote;
    config.insecure = false;
    ::setenv("ZS_INSECURE", "1", 1);
    EXPECT_TRUE(Client::Create(config).ok()) << remote;
    ::unsetenv("ZS_INSECURE");
  }
  EXPECT_TRUE(Client::Create(MakeConfig("plain", {"127.0.0.1:7070", "localhost:7071"}, 0, 2, 2))
                  .ok());
}

// Device buffers on a client without a device are refused before anything
// is sent, and the step goes on with host buffers; a device the machine does
// not have (or a build without CUDA) fails Create.
TEST(ClientTest, DeviceMemoryNeedsAConfiguredDevice) {
  Daemons daemons(1);
  const Layout layout = SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  ClientConfig config = MakeConfig("device", daemons.addresses, 0, 1, 2, "inproc");
  config.cuda_device = -2;
  EXPECT_EQ(ValidateConfig(config).code(), absl::StatusCode::kInvalidArgument);

  // Without CUDA in the build, or without a device 0 here: FailedPrecondition.
  config.cuda_device = 0;
  if (!BuiltWithCuda() || !CreateDeviceCopier(0, 4096).ok()) {
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(config);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
    EXPECT_TRUE(absl::StrContains(c.status().message(), "CUDA")) << c.status();
  }

  config.cuda_device = -1;
  std::unique_ptr<Client> client = Connect(config, layout, init.data());
  ASSERT_NE(client, nullptr);
  const uint64_t total = layout.total_elements();
  std::vector<float> grad(total, 0.25f);
  absl::StatusOr<PushTicket> refused = client->PushGradients(
      {0, total}, grad.data(), DType::kFp32, 0, BufferUse::kCopy, MemoryKind::kCudaDevice);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "cuda_device")) << refused.status();
  std::vector<float> params(total);
  const absl::Status gather =
      client->GatherAll(params.data(), DType::kFp32, MemoryKind::kCudaDevice);
  EXPECT_EQ(gather.code(), absl::StatusCode::kFailedPrecondition) << gather;
  const absl::Status layer =
      client->Gather(layout.layers()[0], params.data(), MemoryKind::kCudaDevice);
  EXPECT_EQ(layer.code(), absl::StatusCode::kFailedPrecondition) << layer;
  // Nothing of the refused push counts: the whole range is still to push.
  ASSERT_TRUE(client->PushGradients({0, total}, grad.data(), DType::kFp32).ok());
  absl::StatusOr<StepResult> r = client->Step(0.1f);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(client->TrafficReport().total.push, total * 4);
}

// With --reduction_hold_ms, staged pushes wait in their slots for their
// range's other contributions and the last one sums them all in one pass:
// the same parameters, bit for bit, in fewer passes over the gradient.
TEST(ClientTest, HeldPushesSumTheirRangeInOnePass) {
  constexpr uint32_t kWorld = 3;
  const Layout layout = SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  std::vector<float> params[2];
  StepEngine::ReductionCounts counts[2];
  for (int hold = 0; hold < 2; ++hold) {
    std::unique_ptr<Daemon> daemon =
        StartDaemon(absl::Seconds(30), hold ? absl::Seconds(20) : absl::ZeroDuration());
    ASSERT_NE(daemon, nullptr);
    std::vector<std::vector<float>> p(kWorld);
    RunRanks(kWorld, [&](uint32_t r) {
      // A push is held only when its deadline leaves twice the hold.
      ClientConfig config = MakeConfig("hold", {daemon->address()}, r, kWorld, 2, "inproc");
      config.rpc_timeout = absl::Seconds(60);
      std::unique_ptr<Client> c = Connect(config, layout, init.data());
      ASSERT_NE(c, nullptr);
      p[r].resize(layout.total_elements());
      for (uint64_t step = 1; step <= 3; ++step) {
        absl::StatusOr<StepResult> s = TrainStep(*c, step, 0.01f, &p[r]);
        ASSERT_TRUE(s.ok()) << s.status();
      }
      ASSERT_TRUE(c->GatherAll(p[r].data(), DType::kFp32).ok());
    });
    params[hold] = p[0];
    counts[hold] = (*daemon->jobs().Find("hold"))->Reductions();
  }
  ASSERT_EQ(params[0].size(), params[1].size());
  EXPECT_EQ(std::memcmp(params[0].data(), params[1].data(), params[0].size() * 4), 0);
  // Held, every range is summed once a step, all ranks' pushes in one pass.
  // Not held, a push summed on arrival takes a pass of its own; pushes that
  // came ahead of their turn share one, so the count there depends on timing.
  EXPECT_EQ(counts[0].contributions, counts[1].contributions);
  EXPECT_EQ(counts[1].passes * kWorld, counts[1].contributions);
  EXPECT_LE(counts[1].passes, counts[0].passes);
  std::printf("passes over the gradient in 3 steps: %lu summing each push, %lu holding them\n",
              static_cast<unsigned long>(counts[0].passes),
              static_cast<unsigned long>(counts[1].passes));
}

TEST(ClientTest, GradientAccumulationNeedsEveryMicroBatch) {
  Daemons daemons(1);
  const Layout layout = SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  ClientConfig config = MakeConfig("accum", daemons.addresses, 0, 1, 2);
  config.micro_batches = 2;
  std::unique_ptr<Client> client = Connect(config, layout, init.data());
  ASSERT_NE(client, nullptr);
  const uint64_t total = layout.total_elements();
  std::vector<float> grad(total, 0.1f);
  ASSERT_TRUE(client->PushGradients({0, total}, grad.data(), DType::kFp32, 0).ok());
  EXPECT_EQ(client->Step(0.1f).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(client->PushGradients({0, total}, grad.data(), DType::kFp32, 0).ok());
  ASSERT_TRUE(client->PushGradients({0, total}, grad.data(), DType::kFp32, 1).ok());
  EXPECT_EQ(client->PushGradients({0, 1}, grad.data(), DType::kFp32, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<StepResult> r = client->Step(0.1f);
  ASSERT_TRUE(r.ok()) << r.status();
  // Two micro-batches of 0.1 sum to the gradient 0.2 per element (the
  // daemon averages over ranks only).
  const double expected = 0.2 * std::sqrt(static_cast<double>(layout.parameter_count()));
  EXPECT_NEAR(r->grad_norm, expected, 1e-3 * expected);
}

// ---- A daemon that is not there, or goes away ----

TEST(ClientTest, UnknownDaemonIsUnavailableWithinTheDeadline) {
  Daemons daemons(1);
  std::string gone;
  {
    auto d = StartDaemon();  // a port nobody listens on any more
    gone = d->address();
    d->Shutdown(absl::ZeroDuration());
  }
  ClientConfig config = MakeConfig("unknown", {daemons.addresses[0], gone}, 0, 2, 2);
  config.rpc_timeout = absl::Seconds(3);
  std::unique_ptr<Client> client = *Client::Create(config);
  const absl::Time start = absl::Now();
  const absl::Status s = client->RegisterModel(SampleLayout(), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), gone)) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
}

// A rank that stops pushing (rank 2, which never steps): the step fails
// within step_timeout on every other rank, leader or not, saying what each
// daemon waits for and from whom.
TEST(ClientTest, StuckStepSaysWhichRankAndRangesItWaitsFor) {
  Daemons daemons(2);
  const Layout layout = SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  std::vector<std::unique_ptr<Client>> clients(3);
  RunRanks(3, [&](uint32_t rank) {
    ClientConfig config = MakeConfig("stuck", daemons.addresses, rank, 3, 2);
    config.step_timeout = absl::Seconds(2);
    clients[rank] = Connect(config, layout, rank == 0 ? init.data() : nullptr);
  });
  ASSERT_TRUE(clients[0] != nullptr && clients[1] != nullptr && clients[2] != nullptr);
  std::vector<float> grad(layout.total_elements(), 0.5f);
  RunRanks(2, [&](uint32_t rank) {
    ASSERT_TRUE(clients[rank]->PushGradients({0, grad.size()}, grad.data(), DType::kFp32).ok());
    const absl::Time start = absl::Now();
    const absl::StatusOr<StepResult> r = clients[rank]->Step(1e-2f);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    for (const std::string& a : daemons.addresses) {
      EXPECT_TRUE(absl::StrContains(
          r.status().message(), absl::StrCat("step 1: daemon ", a, " waits for rank 2, range [")))
          << "rank " << rank << ": " << r.status();
    }
    std::printf("rank %u's Step: %s\n", rank, r.status().ToString().c_str());
  });
}

TEST(ClientTest, DaemonKilledMidRunGivesUnavailable) {
  Daemons daemons(2);
  const std::string victim = daemons.addresses[1];
  const Layout layout = SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  std::vector<std::unique_ptr<Client>> clients(2);
  RunRanks(2, [&](uint32_t rank) {
    ClientConfig config = MakeConfig("killed", daemons.addresses, rank, 2, 2);
    config.rpc_timeout = absl::Seconds(3);
    config.step_timeout = absl::Seconds(20);
    clients[rank] = Connect(config, layout, init.data());
  });
  ASSERT_NE(clients[0], nullptr);
  ASSERT_NE(clients[1], nullptr);
  // Step 1 runs normally.
  RunRanks(2, [&](uint32_t rank) {
    std::vector<float> params(layout.total_elements());
    absl::StatusOr<StepResult> r = TrainStep(*clients[rank], 1, 0.01f, &params);
    EXPECT_TRUE(r.ok()) << r.status();
  });
  // Step 2: rank 1 pushes and waits for the leader, which never pushes; the
  // daemon dies meanwhile.
  const uint64_t total = layout.total_elements();
  std::vector<float> grad(total, 0.1f);
  ASSERT_TRUE(clients[1]->PushGradients({0, total}, grad.data(), DType::kFp32).ok());
  absl::Status follower;
  absl::Time follower_done;
  std::thread waiter([&] {
    follower = clients[1]->Step(0.01f).status();
    follower_done = absl::Now();
  });
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time killed = absl::Now();
  daemons.daemons[1]->Shutdown(absl::ZeroDuration());
  daemons.daemons[1].reset();
  waiter.join();
  EXPECT_EQ(follower.code(), absl::StatusCode::kUnavailable) << follower;
  EXPECT_TRUE(absl::StrContains(follower.message(), victim)) << follower;
  EXPECT_LT(follower_done - killed, absl::Seconds(5));
  // The leader's pushes to the dead daemon fail, and so does its step.
  const absl::Time start = absl::Now();
  absl::StatusOr<PushTicket> t =
      clients[0]->PushGradients({0, total}, grad.data(), DType::kFp32);
  ASSERT_TRUE(t.ok()) << t.status();
  const absl::Status pushed = t->Wait(absl::Now() + absl::Seconds(10));
  EXPECT_EQ(pushed.code(), absl::StatusCode::kUnavailable) << pushed;
  const absl::Status step = clients[0]->Step(0.01f).status();
  EXPECT_EQ(step.code(), absl::StatusCode::kUnavailable) << step;
  EXPECT_TRUE(absl::StrContains(step.message(), victim)) << step;
  std::vector<float> params(total);
  const absl::Status gather = clients[0]->GatherAll(params.data(), DType::kFp32);
  EXPECT_EQ(gather.code(), absl::StatusCode::kUnavailable) << gather;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// ---- The step's contract ----

// A data path whose first Gather after arming blocks until released (or its
// deadline): a stage-3 prefetch that is still running when Step commits.
class HoldFirstGather final : public DataPath {
 public:
  explicit HoldFirstGather(std::unique_ptr<DataPath> inner) : inner_(std::move(inner)) {}
  const std::string& address() const override { return inner_->address(); }
  const char* name() const override { return inner_->name(); }
  absl::StatusOr<uint64_t> PushGradient(const GradientPush& push, absl::Time deadline) override {
    return inner_->PushGradient(push, deadline);
  }
  absl::StatusOr<uint64_t> InitParameters(const ParameterUpload& upload,
                                          absl::Time deadline) override {
    return inner_->InitParameters(upload, deadline);
  }
  absl::StatusOr<uint64_t> Gather(const GatherRequestSpec& request, void* dst,
                                  absl::Time deadline) override {
    if (armed.exchange(false)) {
      holding.Notify();
      release.WaitForNotificationWithDeadline(deadline);
    }
    return inner_->Gather(request, dst, deadline);
  }

  std::atomic<bool> armed{false};
  absl::Notification holding;
  absl::Notification release;

 private:
  std::unique_ptr<DataPath> inner_;
};

// Bug 2: Step used to wait (up to step_timeout) for stage-3 prefetches of
// the old parameters after the commit, and returned DeadlineExceeded with
// the step already committed, breaking the retry contract. Now a committed
// step returns OK at once; the prefetch frees its buffer when it ends, and
// its stale bytes are never served.
TEST(ClientTest, StepNeverFailsAfterItsCommit) {
  Daemons daemons(1);
  const Layout layout = SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  const uint64_t total = layout.total_elements();
  ClientConfig config = MakeConfig("committed", daemons.addresses, 0, 1, 3);
  config.prefetch_depth = 0;
  config.layer_buffers = 2;
  config.step_timeout = absl::Seconds(2);
  config.rpc_timeout = absl::Seconds(8);
  std::unique_ptr<Client> client = *Client::Create(config);
  HoldFirstGather* hold = nullptr;
  ClientTestPeer::WrapDataPath(*client, 0, [&](std::unique_ptr<DataPath> inner) {
    auto h = std::make_unique<HoldFirstGather>(std::move(inner));
    hold = h.get();
    return h;
  });
  ASSERT_TRUE(client->RegisterModel(layout, init.data()).ok());
  const uint32_t layer = layout.layers()[1];
  const FlatRange range = *layout.LayerRange(layer);
  hold->armed = true;
  ASSERT_TRUE(client->Prefetch(layer).ok());
  ASSERT_TRUE(hold->holding.WaitForNotificationWithTimeout(absl::Seconds(5)));
  std::vector<float> grad(total, 0.1f);
  ASSERT_TRUE(client->PushGradients({0, total}, grad.data(), DType::kFp32).ok());
  const absl::Time start = absl::Now();
  absl::StatusOr<StepResult> r = client->Step(0.01f);
  const absl::Duration took = absl::Now() - start;
  hold->release.Notify();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->step, 1u);
  EXPECT_EQ(client->committed_step(), 1u);
  EXPECT_LT(took, config.step_timeout) << "Step waited for the prefetch of the old parameters";
  // The layer now served is step 1's.
  std::vector<float> all(total), one(range.size());
  ASSERT_TRUE(client->GatherAll(all.data(), DType::kFp32).ok());
  ASSERT_TRUE(client->Gather(layer, one.data()).ok());
  EXPECT_EQ(0, std::memcmp(one.data(), all.data() + range.begin, range.size() * 4));
  EXPECT_NE(0, std::memcmp(one.data(), init.data() + range.begin, range.size() * 4));
  // And the next step runs as usual.
  ASSERT_TRUE(client->PushGradients({0, total}, grad.data(), DType::kFp32).ok());
  r = client->Step(0.01f);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->step, 2u);
}

// ---- Liveness and incarnations ----

// The rank timeout is twenty heartbeats, so that a loaded machine (the
// stress runs under ASan) does not stall one rank's heartbeats past it.
TEST(ClientTest, HeartbeatsKeepAnIdleRankConnected) {
  std::unique_ptr<Daemon> daemon = StartDaemon(/*rank_timeout=*/absl::Seconds(1));
  ASSERT_NE(daemon, nullptr);
  const Layout layout = SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  for (const absl::Duration interval : {absl::Milliseconds(50), absl::ZeroDuration()}) {
    const std::string job = absl::StrCat("alive-", absl::ToInt64Milliseconds(interval));
    ClientConfig config = MakeConfig(job, {daemon->address()}, 0, 1, 2);
    config.heartbeat_interval = interval;
    std::unique_ptr<Client> client = Connect(config, layout, init.data());
    ASSERT_NE(client, nullptr);
    absl::SleepFor(absl::Milliseconds(2500));  // idle: no pushes, no steps
    v1::StepState state;
    ASSERT_TRUE(DaemonClient(daemon->address()).StepState(job, &state).ok());
    EXPECT_EQ(state.ranks_joined(), 1u);
    EXPECT_EQ(state.ranks_connected(), interval > absl::ZeroDuration() ? 1u : 0u)
        << "heartbeat_interval " << interval;
    EXPECT_TRUE(client->Leave().ok());
  }
}

TEST(ClientTest, ARestartedRankFencesItsOldProcess) {
  Daemons daemons(1);
  const Layout layout = SampleLayout();
  const std::vector<float> init = InitialParams(layout);
  const uint64_t total = layout.total_elements();
  const ClientConfig config = MakeConfig("restarted", daemons.addresses, 0, 1, 2, "inproc");
  std::unique_ptr<Client> old = Connect(config, layout, init.data());
  ASSERT_NE(old, nullptr);
  std::unique_ptr<Client> fresh = Connect(config, layout, init.data());
  ASSERT_NE(fresh, nullptr);
  EXPECT_GT(fresh->incarnation(), old->incarnation());
  std::vector<float> grad(total, 0.1f);
  // The old process's pushes are refused; the new one's step goes through.
  absl::StatusOr<PushTicket> t = old->PushGradients({0, total}, grad.data(), DType::kFp32);
  ASSERT_TRUE(t.ok()) << t.status();
  const absl::Status refused = t->Wait(absl::Now() + absl::Seconds(10));
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  ASSERT_TRUE(fresh->PushGradients({0, total}, grad.data(), DType::kFp32).ok());
  absl::StatusOr<StepResult> r = fresh->Step(0.01f);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->step, 1u);
}

}  // namespace
}  // namespace zeroshard
