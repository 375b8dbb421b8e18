// Push and gather from CUDA device memory (needs a GPU; built only where
// nvcc was found), in one process: a daemon serving the "ucx" bulk transport
// over shared memory and one rank of a stage-2 job of --bytes fp32
// parameters, the job's precision --precision. Per repetition:
//   device  PushGradients of device gradients (cast to the wire dtype on the
//           device, copied into the pinned staging pool while earlier
//           buckets are sent), Step, GatherAll into device memory (through
//           the pinned bounce buffers, each host-to-device copy overlapping
//           the next gather);
//   host    what a trainer does without it: cudaMemcpy the gradients to a
//           host buffer, cast there (PushGradients converts), push, Step,
//           GatherAll into a host buffer, cudaMemcpy it to the device.
// Both push the same gradient and must end with the same parameters (the
// bench says if not). The copies alone are timed too (cudaMemcpy of the
// same bytes between device and pinned host memory, CUDA events), so the
// overlap shows: a device push that took about as long as its host push
// alone hid its copies. Figures are medians over --reps after a warm-up.
// The last line:
//   device_push_vs_host=A device_gather_vs_host=B
// (time of the host path / time of the device path; > 1: the device path is
// faster).
//   bazel run -c opt //bench:device_bench -- --bytes=268435456

#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/stats.h"
#include "client/client.h"
#include "common/dtype.h"
#include "server/daemon.h"

ABSL_FLAG(uint64_t, bytes, 268435456, "bytes of fp32 parameters in the job (Ψ * 4)");
ABSL_FLAG(uint64_t, bucket_bytes, 32ull << 20, "the client's bucket C_B");
ABSL_FLAG(std::string, precision, "bf16", "the job's precision: fp32 or bf16");
ABSL_FLAG(int, reps, 5, "timed repetitions after one warm-up (the median is reported)");
ABSL_FLAG(std::string, ucx_tls, "posix,cma,self", "UCX_TLS of the daemon and the client");

namespace zeroshard {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

#define CUDA_OR_DIE(call)                                              \
  do {                                                                 \
    const cudaError_t e_ = (call);                                     \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)

#define OK_OR_DIE(expr)                                               \
  do {                                                                \
    const absl::Status s_ = (expr);                                   \
    if (!s_.ok()) {                                                   \
      std::fprintf(stderr, "%s: %s\n", #expr, s_.ToString().c_str()); \
      std::exit(1);                                                   \
    }                                                                 \
  } while (0)

struct Times {
  std::vector<double> push, gather;  // seconds
  std::vector<float> params;         // after the last repetition
};

Times Run(Daemon& daemon, bool device, DType precision) {
  const uint64_t n = absl::GetFlag(FLAGS_bytes) / sizeof(float);
  const Layout layout = *Layout::Create({{"w", {static_cast<int64_t>(n)}, DType::kFp32, 0}});
  const uint64_t total = layout.total_elements();
  ClientConfig c;
  c.job_token = "device-bench-job-token";
  c.daemons = {daemon.address()};
  c.job_id = device ? "device-bench-device" : "device-bench-host";
  c.stage = 2;
  c.precision = precision;
  c.bucket_bytes = absl::GetFlag(FLAGS_bucket_bytes);
  c.transport = "ucx";
  c.ucx_tls = absl::GetFlag(FLAGS_ucx_tls);
  c.rpc_timeout = absl::Seconds(120);
  c.step_timeout = absl::Seconds(300);
  c.cuda_device = device ? 0 : -1;
  std::vector<float> init(total, 0.5f), grads(total);
  for (uint64_t i = 0; i < total; ++i) grads[i] = 1e-3f * static_cast<float>(i % 1000);
  void* dev_grads = nullptr;
  void* dev_params = nullptr;
  CUDA_OR_DIE(cudaMalloc(&dev_grads, total * 4));
  CUDA_OR_DIE(cudaMalloc(&dev_params, total * 4));
  CUDA_OR_DIE(cudaMemcpy(dev_grads, grads.data(), total * 4, cudaMemcpyHostToDevice));
  std::vector<float> host_grads(total), host_params(total);
  Times t;
  {
    std::unique_ptr<Client> client = *Client::Create(c);
    OK_OR_DIE(client->RegisterModel(layout, init.data()));
    for (int rep = 0; rep <= absl::GetFlag(FLAGS_reps); ++rep) {
      const double t0 = Now();
      absl::StatusOr<PushTicket> ticket;
      if (device) {
        ticket = client->PushGradients({0, total}, dev_grads, DType::kFp32, 0, BufferUse::kCopy,
                                       MemoryKind::kCudaDevice);
      } else {
        CUDA_OR_DIE(cudaMemcpy(host_grads.data(), dev_grads, total * 4, cudaMemcpyDeviceToHost));
        ticket = client->PushGradients({0, total}, host_grads.data(), DType::kFp32);
      }
      OK_OR_DIE(ticket.status());
      OK_OR_DIE(ticket->Wait(absl::Now() + absl::Seconds(300)));
      const double t1 = Now();
      OK_OR_DIE(client->Step(1e-4f).status());
      const double t2 = Now();
      if (device) {
        OK_OR_DIE(client->GatherAll(dev_params, DType::kFp32, MemoryKind::kCudaDevice));
      } else {
        OK_OR_DIE(client->GatherAll(host_params.data(), DType::kFp32));
        CUDA_OR_DIE(cudaMemcpy(dev_params, host_params.data(), total * 4, cudaMemcpyHostToDevice));
      }
      const double t3 = Now();
      if (rep > 0) {
        t.push.push_back(t1 - t0);
        t.gather.push_back(t3 - t2);
      }
    }
    client->Leave().IgnoreError();
  }
  t.params.resize(total);
  CUDA_OR_DIE(cudaMemcpy(t.params.data(), dev_params, total * 4, cudaMemcpyDeviceToHost));
  cudaFree(dev_grads);
  cudaFree(dev_params);
  return t;
}

// Median seconds of cudaMemcpy of `bytes` between device and pinned host
// memory in direction `kind`, timed with CUDA events.
double CopySeconds(size_t bytes, cudaMemcpyKind kind) {
  void* dev = nullptr;
  void* host = nullptr;
  CUDA_OR_DIE(cudaMalloc(&dev, bytes));
  CUDA_OR_DIE(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
  cudaEvent_t begin, end;
  CUDA_OR_DIE(cudaEventCreate(&begin));
  CUDA_OR_DIE(cudaEventCreate(&end));
  std::vector<double> times;
  for (int rep = 0; rep <= absl::GetFlag(FLAGS_reps); ++rep) {
    CUDA_OR_DIE(cudaEventRecord(begin));
    CUDA_OR_DIE(kind == cudaMemcpyDeviceToHost ? cudaMemcpy(host, dev, bytes, kind)
                                               : cudaMemcpy(dev, host, bytes, kind));
    CUDA_OR_DIE(cudaEventRecord(end));
    CUDA_OR_DIE(cudaEventSynchronize(end));
    float ms = 0;
    CUDA_OR_DIE(cudaEventElapsedTime(&ms, begin, end));
    if (rep > 0) times.push_back(ms / 1e3);
  }
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  cudaFreeHost(host);
  cudaFree(dev);
  return bench::Median(times);
}

int Main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "device_bench: no CUDA device\n");
    return 1;
  }
  const std::string precision_name = absl::GetFlag(FLAGS_precision);
  if (precision_name != "fp32" && precision_name != "bf16") {
    std::fprintf(stderr, "--precision: fp32 or bf16, got %s\n", precision_name.c_str());
    return 2;
  }
  const DType precision = precision_name == "fp32" ? DType::kFp32 : DType::kBf16;
  DaemonOptions o;
  o.bulk_transport = "ucx";
  o.ucx_tls = absl::GetFlag(FLAGS_ucx_tls);
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(o);
  OK_OR_DIE(daemon.status());
  const uint64_t bytes = absl::GetFlag(FLAGS_bytes) / 4 * 4;
  const size_t wire = DTypeSize(precision);
  const Times host = Run(**daemon, false, precision);
  const Times device = Run(**daemon, true, precision);
  const double d2h = CopySeconds(bytes, cudaMemcpyDeviceToHost);
  const double h2d = CopySeconds(bytes, cudaMemcpyHostToDevice);
  const double host_push = bench::Median(host.push), device_push = bench::Median(device.push);
  const double host_gather = bench::Median(host.gather);
  const double device_gather = bench::Median(device.gather);
  std::printf("job: %llu fp32 parameters, precision %s (%zu wire bytes each), C_B %llu B\n",
              static_cast<unsigned long long>(bytes / 4), precision_name.c_str(), wire,
              static_cast<unsigned long long>(absl::GetFlag(FLAGS_bucket_bytes)));
  std::printf("cudaMemcpy alone, pinned: device-to-host %.2f ms, host-to-device %.2f ms\n",
              d2h * 1e3, h2d * 1e3);
  std::printf("push:   host path (copy + push) %.2f ms, device path %.2f ms\n", host_push * 1e3,
              device_push * 1e3);
  std::printf("gather: host path (gather + copy) %.2f ms, device path %.2f ms\n", host_gather * 1e3,
              device_gather * 1e3);
  const bool same =
      std::memcmp(host.params.data(), device.params.data(), host.params.size() * 4) == 0;
  std::printf("parameters after %d steps: %s\n", absl::GetFlag(FLAGS_reps) + 1,
              same ? "identical" : "DIFFERENT (a bug)");
  std::printf("device_push_vs_host=%.3f device_gather_vs_host=%.3f\n", host_push / device_push,
              host_gather / device_gather);
  return same ? 0 : 1;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
