// Trainer buffers in CUDA device memory (needs a GPU; skips without one):
// the copier's casts and copies against the host conversions, and a job
// trained from device gradients into device parameters against the same job
// trained from host buffers, bit for bit, at stages 2 and 3 in fp32 and
// bf16. Prints how long each device push took to return (the casts and
// copies into the staging pool; the sends run behind it).

#include "client/device_memory.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/testing/training_data.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

// Device memory freed at scope exit.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(p); }
  void* p = nullptr;
};

class DeviceMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<DeviceCopier>> c = CreateDeviceCopier(0, 1 << 20);
    if (!c.ok()) GTEST_SKIP() << "no CUDA device: " << c.status();
    copier_ = *std::move(c);
  }
  std::unique_ptr<DeviceCopier> copier_;
};

absl::Time Soon() { return absl::Now() + absl::Seconds(30); }

TEST_F(DeviceMemoryTest, CastsAndCopiesMatchTheHostConversions) {
  // More elements than the scratch buffer holds: the cast runs in chunks.
  const size_t n = (1 << 20) / 4 * 3 + 17;
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 9973) * 0.37f - 1000.0f;
  DeviceBuffer dev(n * 4);
  ASSERT_EQ(cudaMemcpy(dev.p, host.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(copier_->CheckDevicePointer(dev.p, n * 4, "dev").ok());
  EXPECT_EQ(copier_->CheckDevicePointer(host.data(), n * 4, "host").code(),
            absl::StatusCode::kInvalidArgument);

  std::vector<float> back(n);
  ASSERT_TRUE(copier_->ToHost(dev.p, DType::kFp32, back.data(), DType::kFp32, n, Soon()).ok());
  EXPECT_EQ(std::memcmp(back.data(), host.data(), n * 4), 0);

  for (DType half : {DType::kBf16, DType::kFp16}) {
    std::vector<uint16_t> packed(n), expected(n);
    FromFloat(half, host.data(), expected.data(), n);
    ASSERT_TRUE(copier_->ToHost(dev.p, DType::kFp32, packed.data(), half, n, Soon()).ok());
    EXPECT_EQ(packed, expected) << DTypeName(half);
    // And back: half on the device, unpacked to fp32 there.
    DeviceBuffer dev_half(n * 2);
    ASSERT_EQ(cudaMemcpy(dev_half.p, expected.data(), n * 2, cudaMemcpyHostToDevice), cudaSuccess);
    std::vector<float> unpacked(n), want(n);
    ToFloat(half, expected.data(), want.data(), n);
    ASSERT_TRUE(copier_->ToHost(dev_half.p, half, unpacked.data(), DType::kFp32, n, Soon()).ok());
    EXPECT_EQ(std::memcmp(unpacked.data(), want.data(), n * 4), 0) << DTypeName(half);
  }
  std::vector<uint16_t> other(n);
  EXPECT_EQ(copier_->ToHost(dev.p, DType::kBf16, other.data(), DType::kFp16, n, Soon()).code(),
            absl::StatusCode::kInvalidArgument);

  // Host to device on both lanes.
  DeviceBuffer dev2(n * 4);
  const size_t half_bytes = n / 2 * 4;
  ASSERT_TRUE(copier_->FromHostAsync(host.data(), dev2.p, half_bytes, 0).ok());
  ASSERT_TRUE(copier_
                  ->FromHostAsync(host.data() + n / 2, static_cast<uint8_t*>(dev2.p) + half_bytes,
                                  n * 4 - half_bytes, 1)
                  .ok());
  ASSERT_TRUE(copier_->WaitLane(0, Soon()).ok());
  ASSERT_TRUE(copier_->WaitLane(1, Soon()).ok());
  std::vector<float> round(n);
  ASSERT_EQ(cudaMemcpy(round.data(), dev2.p, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::memcmp(round.data(), host.data(), n * 4), 0);
  EXPECT_EQ(copier_->FromHostAsync(host.data(), dev2.p, 4, DeviceCopier::kLanes).code(),
            absl::StatusCode::kInvalidArgument);
}

struct TrainedRun {
  std::vector<float> params;  // after the steps
  std::vector<float> losses;  // the step's gradient norms
};

// `steps` steps of a one-rank job of SampleLayout over the "inproc" bulk
// transport, gradients and parameters on the device or on the host; stage 3
// gathers layer by layer, stages 1-2 everything at once.
TrainedRun Train(const std::string& address, const std::string& job, uint32_t stage,
                 DType precision, bool device, int steps) {
  const Layout layout = testing::SampleLayout();
  const std::vector<float> init = testing::InitialParams(layout);
  ClientConfig c;
  c.job_token = testing::kTestToken;
  c.daemons = {address};
  c.job_id = job;
  c.world_size = 1;
  c.stage = stage;
  c.precision = precision;
  c.bucket_bytes = 4096;
  c.optimizer.lr = 1e-2f;
  c.transport = "inproc";
  c.cuda_device = device ? 0 : -1;
  TrainedRun run;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(c);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return run;
  EXPECT_TRUE((*client)->RegisterModel(layout, init.data()).ok());
  const uint64_t total = layout.total_elements();
  std::vector<float> params(total), grad(total);
  DeviceBuffer dev_params(total * 4), dev_grad(total * 4);
  for (int step = 1; step <= steps; ++step) {
    // fp32 parameters: stages 1-2 gather fp32, stage 3 the job's precision
    // (converted here).
    if (stage == 3) {
      const size_t esize = DTypeSize(precision);
      std::vector<uint8_t> layer_bytes;
      for (uint32_t layer : layout.layers()) {
        const FlatRange r = *layout.LayerRange(layer);
        layer_bytes.resize(r.size() * esize);
        if (device) {
          void* at = static_cast<uint8_t*>(dev_params.p) + r.begin * esize;
          EXPECT_TRUE((*client)->Gather(layer, at, MemoryKind::kCudaDevice).ok());
          EXPECT_EQ(cudaMemcpy(layer_bytes.data(), at, layer_bytes.size(), cudaMemcpyDeviceToHost),
                    cudaSuccess);
        } else {
          EXPECT_TRUE((*client)->Gather(layer, layer_bytes.data()).ok());
        }
        ToFloat(precision, layer_bytes.data(), params.data() + r.begin, r.size());
      }
    } else if (device) {
      EXPECT_TRUE((*client)->GatherAll(dev_params.p, DType::kFp32, MemoryKind::kCudaDevice).ok());
      EXPECT_EQ(cudaMemcpy(params.data(), dev_params.p, total * 4, cudaMemcpyDeviceToHost),
                cudaSuccess);
    } else {
      EXPECT_TRUE((*client)->GatherAll(params.data(), DType::kFp32).ok());
    }
    testing::ComputeGradient(params.data(), 0, total, 0, step, grad.data());
    absl::StatusOr<PushTicket> t;
    if (device) {
      EXPECT_EQ(cudaMemcpy(dev_grad.p, grad.data(), total * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
      const absl::Time t0 = absl::Now();
      t = (*client)->PushGradients({0, total}, dev_grad.p, DType::kFp32, 0, BufferUse::kCopy,
                                   MemoryKind::kCudaDevice);
      const absl::Duration wall = absl::Now() - t0;
      std::printf("step %d: device push of %lu fp32 elements returned after %.3f ms\n", step,
                  static_cast<unsigned long>(total), absl::ToDoubleMilliseconds(wall));
    } else {
      t = (*client)->PushGradients({0, total}, grad.data(), DType::kFp32);
    }
    EXPECT_TRUE(t.ok()) << t.status();
    absl::StatusOr<StepResult> r = (*client)->Step(1e-2f);
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) run.losses.push_back(r->grad_norm);
  }
  run.params.resize(total);
  EXPECT_TRUE((*client)->GatherAll(run.params.data(), DType::kFp32).ok());
  return run;
}

TEST_F(DeviceMemoryTest, DeviceBuffersTrainLikeHostBuffers) {
  DaemonOptions o;
  o.bulk_transport = "inproc";
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(o);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  for (uint32_t stage : {2u, 3u}) {
    for (DType precision : {DType::kFp32, DType::kBf16}) {
      const std::string name = absl::StrCat("stage", stage, "-", DTypeName(precision));
      const TrainedRun host =
          Train((*daemon)->address(), "host-" + name, stage, precision, false, 3);
      const TrainedRun device =
          Train((*daemon)->address(), "device-" + name, stage, precision, true, 3);
      ASSERT_EQ(host.params.size(), device.params.size());
      EXPECT_EQ(std::memcmp(host.params.data(), device.params.data(), host.params.size() * 4), 0)
          << name;
      EXPECT_EQ(host.losses, device.losses) << name;
    }
  }
}

}  // namespace
}  // namespace zeroshard
