// The NCCL trainer collective. Its refusals (host memory, a client without
// a device) need no GPU and run wherever CUDA was found at build time. The
// training run needs GPUs and skips without one: ranks as threads, one GPU
// each (NCCL refuses two ranks of one communicator on a device), so one
// rank on a one-GPU machine and up to four where there are more. It trains
// a job from device buffers through the Client at stages 2 and 3, fp32 and
// bf16, and compares it with the Gloo trainer collective on host buffers:
// bit for bit with one or two ranks (a sum of two is the same in any order),
// with more within a relative 1e-5 in fp32 and 1e-2 in bf16 (NCCL's
// summation order is not rank order, and bf16 rounds a last-bit difference
// to a whole half-precision step). A missing rank is tested with one GPU:
// the rank that never gathers never joins the communicator, so both ranks
// can name device 0.

#include "client/nccl_collective.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/gloo_collective.h"
#include "client/testing/ranks.h"
#include "client/testing/training_data.h"
#include "common/dtype.h"
#include "cuda/cuda_ops.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using testing::RunRanks;

std::string FreshDir() { return testing::FreshDir("nccl"); }

ClientConfig Config(const std::vector<std::string>& daemons, const std::string& job, uint32_t rank,
                    uint32_t world, uint32_t stage, DType precision) {
  ClientConfig c;
  c.job_token = testing::kTestToken;
  c.daemons = daemons;
  c.job_id = job;
  c.rank = rank;
  c.world_size = world;
  c.stage = stage;
  c.precision = precision;
  c.bucket_bytes = 4096;
  c.optimizer.lr = 1e-2f;
  c.rpc_timeout = absl::Seconds(20);
  c.step_timeout = absl::Seconds(60);
  c.reduction = ReductionMode::kTrainerCollective;
  c.micro_batches = 2;  // the second one is added on the device
  return c;
}

TEST(NcclCollectiveTest, RefusesHostMemoryAndAClientWithoutADevice) {
  EXPECT_EQ(NcclCollective::Create({}).status().code(), absl::StatusCode::kInvalidArgument);
  NcclCollective::Options o;
  o.rendezvous_dir = FreshDir();
  std::unique_ptr<NcclCollective> c = *NcclCollective::Create(o);
  std::vector<float> host(10, 1.0f);
  absl::StatusOr<PushTicket> t =
      c->Reduce(1, 0, {0, 10}, host.data(), DType::kFp32, BufferUse::kCopy, MemoryKind::kHost,
                absl::Now() + absl::Seconds(5));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("takes cuda_device memory only"), std::string::npos)
      << t.status();
  const absl::Status g = c->AllGather(
      {0, 10}, host.data(), DType::kFp32, MemoryKind::kHost,
      [](const FlatRange&, void*) { return absl::OkStatus(); }, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(g.code(), absl::StatusCode::kFailedPrecondition) << g;
  EXPECT_NE(g.message().find("takes cuda_device memory only"), std::string::npos) << g;

  // Through the Client: a client with no device cannot bind it.
  std::unique_ptr<Daemon> daemon = testing::StartDaemon();
  const Layout layout = testing::SampleLayout();
  const std::vector<float> init = testing::InitialParams(layout);
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Create(Config({daemon->address()}, "nccl-no-device", 0, 1, 2, DType::kFp32),
                     *NcclCollective::Create(o));
  ASSERT_TRUE(client.ok()) << client.status();
  const absl::Status r = (*client)->RegisterModel(layout, init.data());
  EXPECT_EQ(r.code(), absl::StatusCode::kFailedPrecondition) << r;
  EXPECT_NE(r.message().find("cuda_device"), std::string::npos) << r;
}

// Device memory freed at scope exit, on the device current at creation.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(p); }
  void* p = nullptr;
};

struct RankResult {
  std::vector<float> params;  // after the steps
  TrafficBytes last_step;
};

// Three steps of rank `rank`: gradients and parameters on device `rank`
// through `collective` (NCCL), or on the host (Gloo).
RankResult TrainRank(const ClientConfig& config, std::unique_ptr<Collective> collective,
                     bool device) {
  const Layout layout = testing::SampleLayout();
  const std::vector<float> init = testing::InitialParams(layout);
  const uint64_t total = layout.total_elements();
  const MemoryKind memory = device ? MemoryKind::kCudaDevice : MemoryKind::kHost;
  RankResult result;
  if (device) cudaSetDevice(config.cuda_device);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(config, std::move(collective));
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return result;
  EXPECT_TRUE((*client)->RegisterModel(layout, init.data()).ok());
  const size_t esize = DTypeSize(config.precision);
  std::vector<float> params(total), grad(total);
  std::vector<uint8_t> layer_bytes;
  DeviceBuffer dev_params(device ? total * 4 : 1), dev_grad(device ? total * 4 : 1);
  // Where a gather of `bytes` lands: the device buffer, or host memory.
  auto gathered = [&](void* host_dst, size_t bytes, size_t offset,
                      const std::function<absl::Status(void*)>& gather) {
    void* dst = device ? static_cast<uint8_t*>(dev_params.p) + offset : host_dst;
    const absl::Status s = gather(dst);
    EXPECT_TRUE(s.ok()) << "rank " << config.rank << ": " << s;
    if (device) {
      EXPECT_EQ(cudaMemcpy(host_dst, dst, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    }
  };
  for (int step = 1; step <= 3; ++step) {
    if (config.stage == 3) {
      for (uint32_t layer : layout.layers()) {
        const FlatRange r = *layout.LayerRange(layer);
        layer_bytes.resize(r.size() * esize);
        gathered(layer_bytes.data(), layer_bytes.size(), r.begin * esize,
                 [&](void* dst) { return (*client)->Gather(layer, dst, memory); });
        ToFloat(config.precision, layer_bytes.data(), params.data() + r.begin, r.size());
      }
    } else {
      gathered(params.data(), total * 4, 0,
               [&](void* dst) { return (*client)->GatherAll(dst, DType::kFp32, memory); });
    }
    testing::ComputeGradient(params.data(), 0, total, config.rank, step, grad.data());
    const void* src = grad.data();
    if (device) {
      EXPECT_EQ(cudaMemcpy(dev_grad.p, grad.data(), total * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
      src = dev_grad.p;
    }
    // The same gradient as both micro-batches, in two halves each.
    for (uint32_t micro_batch = 0; micro_batch < 2; ++micro_batch) {
      for (const FlatRange& half : {FlatRange{0, total / 2}, FlatRange{total / 2, total}}) {
        absl::StatusOr<PushTicket> t =
            (*client)->PushGradients(half, static_cast<const uint8_t*>(src) + half.begin * 4,
                                     DType::kFp32, micro_batch, BufferUse::kCopy, memory);
        EXPECT_TRUE(t.ok()) << "rank " << config.rank << ": " << t.status();
      }
    }
    absl::StatusOr<StepResult> r = (*client)->Step(1e-2f);
    EXPECT_TRUE(r.ok()) << "rank " << config.rank << ": " << r.status();
    if (!r.ok()) return result;
  }
  result.params.resize(total);
  gathered(result.params.data(), total * 4, 0,
           [&](void* dst) { return (*client)->GatherAll(dst, DType::kFp32, memory); });
  result.last_step = (*client)->TrafficReport().last_step;
  return result;
}

TEST(NcclCollectiveTest, TrainsLikeTheGlooCollectiveThroughTheClient) {
  absl::StatusOr<int> devices = cuda::DeviceCount();
  if (!devices.ok()) GTEST_SKIP() << devices.status();
  const uint32_t world = static_cast<uint32_t>(std::min(*devices, 4));
  std::printf("%u rank(s), one per GPU (%d visible)\n", world, *devices);
  std::vector<std::unique_ptr<Daemon>> daemons;
  std::vector<std::string> addresses;
  for (int d = 0; d < 2; ++d) {
    daemons.push_back(testing::StartDaemon());
    addresses.push_back(daemons.back()->address());
  }
  for (uint32_t stage : {2u, 3u}) {
    for (DType precision : {DType::kFp32, DType::kBf16}) {
      const std::string name = absl::StrCat("stage", stage, "-", DTypeName(precision));
      std::vector<RankResult> gloo(world), nccl(world);
      for (bool device : {false, true}) {
        const std::string dir = FreshDir();
        const std::string job = absl::StrCat(device ? "nccl-" : "gloo-", name);
        RunRanks(world, [&](uint32_t rank) {
          ClientConfig c = Config(addresses, job, rank, world, stage, precision);
          std::unique_ptr<Collective> collective;
          if (device) {
            c.cuda_device = static_cast<int>(rank);
            NcclCollective::Options o;
            o.rendezvous_dir = dir;
            collective = *NcclCollective::Create(o);
          } else {
            GlooCollective::Options o;
            o.rendezvous_dir = dir;
            collective = *GlooCollective::Create(o);
          }
          (device ? nccl : gloo)[rank] = TrainRank(c, std::move(collective), device);
        });
      }
      for (uint32_t r = 0; r < world; ++r) {
        ASSERT_EQ(nccl[r].params.size(), gloo[r].params.size()) << name << " rank " << r;
        if (world <= 2) {
          EXPECT_EQ(0, std::memcmp(nccl[r].params.data(), gloo[r].params.data(),
                                   gloo[r].params.size() * 4))
              << name << " rank " << r;
        } else {
          // Another summation order: the reduced gradient may differ in its
          // last bits, and a bf16 job rounds that to a different half value.
          const float tolerance = precision == DType::kFp32 ? 1e-5f : 1e-2f;
          for (size_t i = 0; i < gloo[r].params.size(); ++i) {
            ASSERT_NEAR(nccl[r].params[i], gloo[r].params[i],
                        tolerance * (1.0f + std::fabs(gloo[r].params[i])))
                << name << " element " << i;
          }
        }
        // The daemons see the same bytes either way: partition r, pushed
        // and gathered.
        EXPECT_EQ(nccl[r].last_step.push, gloo[r].last_step.push) << name;
        EXPECT_EQ(nccl[r].last_step.gather, gloo[r].last_step.gather) << name;
      }
      std::printf(
          "%s rank 0 last step: daemon push %lu B, gather %lu B; collective sent %lu B "
          "(gloo %lu B), received %lu B (gloo %lu B)\n",
          name.c_str(), static_cast<unsigned long>(nccl[0].last_step.push),
          static_cast<unsigned long>(nccl[0].last_step.gather),
          static_cast<unsigned long>(nccl[0].last_step.collective_sent),
          static_cast<unsigned long>(gloo[0].last_step.collective_sent),
          static_cast<unsigned long>(nccl[0].last_step.collective_received),
          static_cast<unsigned long>(gloo[0].last_step.collective_received));
    }
  }
}

// Needs one GPU: rank 1 registers but never gathers, so rank 0's first
// gather waits for it in the communicator's creation until its deadline,
// and the collective is broken afterwards. Rank 1 never joins NCCL, so it
// may use rank 0's device.
TEST(NcclCollectiveTest, AMissingRankIsDeadlineExceededThenBroken) {
  absl::StatusOr<int> devices = cuda::DeviceCount();
  if (!devices.ok()) GTEST_SKIP() << devices.status();
  std::unique_ptr<Daemon> daemon = testing::StartDaemon();
  const Layout layout = testing::SampleLayout();
  const std::vector<float> init = testing::InitialParams(layout);
  const std::string dir = FreshDir();
  std::vector<std::unique_ptr<Client>> clients(2);
  RunRanks(2, [&](uint32_t rank) {
    cudaSetDevice(0);
    ClientConfig c = Config({daemon->address()}, "nccl-missing", rank, 2, 2, DType::kFp32);
    c.cuda_device = 0;
    c.step_timeout = absl::Seconds(3);
    NcclCollective::Options o;
    o.rendezvous_dir = dir;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(c, *NcclCollective::Create(o));
    ASSERT_TRUE(client.ok()) << client.status();
    ASSERT_TRUE((*client)->RegisterModel(layout, init.data()).ok());
    clients[rank] = *std::move(client);
  });
  ASSERT_NE(clients[0], nullptr);
  cudaSetDevice(0);
  DeviceBuffer params(layout.total_elements() * 4);
  const absl::Time start = absl::Now();
  const absl::Status s = clients[0]->GatherAll(params.p, DType::kFp32, MemoryKind::kCudaDevice);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  const absl::Status again = clients[0]->GatherAll(params.p, DType::kFp32, MemoryKind::kCudaDevice);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  EXPECT_NE(again.message().find("failed earlier"), std::string::npos) << again;
}

}  // namespace
}  // namespace zeroshard
