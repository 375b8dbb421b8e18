#include "client/nccl_collective.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "cuda/cuda_ops.h"

namespace zeroshard {
namespace {

constexpr char kWhat[] = "trainer collective (NCCL)";
// The pinned host buffer holds at least this much (two gather halves).
constexpr uint64_t kMinHostBytes = uint64_t{64} << 10;

ncclDataType_t NcclType(DType dtype) {
  switch (dtype) {
    case DType::kBf16:
      return ncclBfloat16;
    case DType::kFp16:
      return ncclFloat16;
    case DType::kFp32:
      break;
  }
  return ncclFloat32;
}

// The id file, read whole; false while it is absent or short.
bool ReadId(const std::string& path, ncclUniqueId* id) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const ssize_t n = read(fd, id, sizeof(*id));
  close(fd);
  return n == static_cast<ssize_t>(sizeof(*id));
}

// Polls `comm`'s asynchronous state (a non-blocking communicator's calls
// still being issued) until it is no longer ncclInProgress, or until
// `deadline` (then ncclInProgress). An error of the query itself is
// returned as the state.
ncclResult_t AwaitCommState(ncclComm_t comm, absl::Time deadline) {
  for (int spins = 0;; ++spins) {
    ncclResult_t state = ncclInProgress;
    if (ncclResult_t r = ncclCommGetAsyncError(comm, &state); r != ncclSuccess) return r;
    if (state != ncclInProgress || absl::Now() >= deadline) return state;
    cuda::PollPause(spins);
  }
}

}  // namespace

NcclCollective::NcclCollective(const Options& options)
    : TrainerCollective(kWhat), options_(options) {}

absl::StatusOr<std::unique_ptr<NcclCollective>> NcclCollective::Create(const Options& options) {
  if (options.rendezvous_dir.empty()) {
    return absl::InvalidArgumentError(
        "rendezvous_dir: required (a directory every rank of the job shares)");
  }
  return std::unique_ptr<NcclCollective>(new NcclCollective(options));
}

NcclCollective::~NcclCollective() {
  if (device_ == nullptr) return;  // never allocated
  cuda::DeviceScope scope(device_index_);
  if (comm_ != nullptr) {
    // Flush, then destroy; a finalize that does not end in 10 s is aborted
    // (by Release).
    ncclResult_t state = ncclCommFinalize(comm_);
    if (state == ncclInProgress) state = AwaitCommState(comm_, absl::Now() + absl::Seconds(10));
    if (state == ncclSuccess) {
      ncclCommDestroy(comm_);
      comm_ = nullptr;
    }
  }
  Release();
}

void NcclCollective::Release() {
  cuda::DeviceScope scope(device_index_);
  AbortAndDrain();
  if (accumulate_stream_ != nullptr) cudaStreamSynchronize(accumulate_stream_);
  if (acc_ != nullptr) cudaFree(acc_);
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (accumulate_stream_ != nullptr) cudaStreamDestroy(accumulate_stream_);
  if (host_pinned_) device_->Unpin(host_.data());
  cudaGetLastError();
  acc_ = nullptr;
  done_ = nullptr;
  stream_ = accumulate_stream_ = nullptr;
  host_ = PinnableBuffer();
  host_pinned_ = false;
  device_ = nullptr;
  device_index_ = -1;
}

uint64_t NcclCollective::allocated_bytes() const { return host_.size(); }

absl::Status NcclCollective::Allocate(const CollectiveJob& job, const BucketPlan& plan) {
  absl::Status s = AllocateBuffers(job, plan);
  // A failed Bind keeps nothing, so that it can be tried again.
  if (!s.ok() && device_ != nullptr) Release();
  return s;
}

absl::Status NcclCollective::AllocateBuffers(const CollectiveJob& job, const BucketPlan& plan) {
  if (job.device == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("the ", kWhat,
                     " reduces on a CUDA device, but the client has none: set "
                     "ClientConfig.cuda_device"));
  }
  // Set before anything is allocated: Release frees what is there.
  device_ = job.device;
  device_index_ = device_->device();
  cuda::DeviceScope scope(device_index_);
  auto failed = [&](const absl::Status& s) {
    return absl::Status(absl::IsInternal(s) ? absl::StatusCode::kFailedPrecondition : s.code(),
                        absl::StrCat(kWhat, " on CUDA device ", device_index_, " (rank ", job.rank,
                                     " of ", job.world_size, "): ", s.message()));
  };
  const uint64_t acc_elements = job.map->padded_elements();
  if (acc_elements < plan.total_elements()) {
    return absl::InvalidArgumentError(absl::StrCat("CollectiveJob: partitions of ",
                                                   job.map->partition_elements(),
                                                   " elements do not cover the layout"));
  }
  // Blocking streams: ordered with the legacy default stream's work.
  absl::Status s = cuda::CudaStatus(cudaStreamCreate(&stream_), "stream");
  if (s.ok()) s = cuda::CudaStatus(cudaStreamCreate(&accumulate_stream_), "stream");
  if (s.ok()) {
    s = cuda::CudaStatus(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "event");
  }
  if (!s.ok()) return failed(s);
  const uint64_t acc_bytes = acc_elements * sizeof(float);
  s = cuda::CudaStatus(
      cudaMalloc(reinterpret_cast<void**>(&acc_), acc_bytes),
      absl::StrCat("cudaMalloc of ", acc_bytes, " bytes for the fp32 accumulator"));
  if (!s.ok()) {
    acc_ = nullptr;
    return absl::ResourceExhaustedError(failed(s).message());
  }
  // Gaps and padding stay 0 for good: Accumulate writes real elements only.
  s = cuda::CudaStatus(cudaMemsetAsync(acc_, 0, acc_bytes, stream_), "memset");
  if (s.ok()) s = cuda::CudaStatus(cudaStreamSynchronize(stream_), "memset");
  if (!s.ok()) return failed(s);
  const uint64_t host_bytes =
      std::max<uint64_t>(kMinHostBytes, BucketPlan::StagingBytes(job.bucket_bytes, job.wire_dtype));
  PinnableBuffer host(host_bytes);
  if (host.data() == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        kWhat, ": cannot allocate ", host_bytes, " bytes of host staging (rank ", job.rank, ")"));
  }
  s = device_->Pin(host.data(), host.size());
  if (!s.ok()) return failed(s);
  host_ = std::move(host);
  host_pinned_ = true;
  return absl::OkStatus();
}

absl::Status NcclCollective::CheckBuffer(const void* p, uint64_t bytes, const char* what) const {
  return device_->CheckDevicePointer(p, bytes, what);
}

absl::Status NcclCollective::Accumulate(uint32_t micro_batch, const FlatRange& range,
                                        const void* grads, DType dtype, absl::Time deadline) {
  cuda::DeviceScope scope(device_index_);
  // An event of this call's own: concurrent calls (disjoint ranges) launch
  // on the same in-order stream, and each waits for its kernels (and those
  // launched on it before them), not for calls launched after it.
  cudaEvent_t done = nullptr;
  absl::Status status =
      cuda::CudaStatus(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "event");
  if (!status.ok()) return status;
  const auto* src = static_cast<const uint8_t*>(grads);
  const size_t esize = DTypeSize(dtype);
  plan().ForEachRealSegment(range, [&](const FlatRange& s) {
    if (!status.ok()) return;
    const void* from = src + (s.begin - range.begin) * esize;
    float* to = acc_ + s.begin;
    // The first micro-batch overwrites the last step's values.
    status = micro_batch == 0 ? cuda::UnpackToFloat(from, dtype, to, s.size(), accumulate_stream_)
                              : cuda::AddIntoFloat(from, dtype, to, s.size(), accumulate_stream_);
  });
  if (absl::Status s = cuda::CudaStatus(cudaEventRecord(done, accumulate_stream_), "event");
      !s.ok()) {
    // An event never recorded reads as complete: wait for the whole stream.
    if (cudaStreamSynchronize(accumulate_stream_) != cudaSuccess) cudaGetLastError();
    cudaEventDestroy(done);
    return status.ok() ? s : status;
  }
  // The kernels read the caller's buffer: wait for them even past the
  // deadline (they take microseconds; the sum is complete then, so a late
  // end is said on stderr, not returned as an error).
  absl::StatusOr<bool> late = cuda::WaitForEvent(done, deadline, "gradient accumulation");
  if (status.ok()) status = late.status();
  cudaEventDestroy(done);
  return status;
}

std::string NcclCollective::IdPath() const {
  return absl::StrCat(options_.rendezvous_dir, "/zeroshard-nccl-", job().job_id, ".id");
}

absl::Status NcclCollective::CommStatus(ncclResult_t r, const std::string& what) const {
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  const char* last = comm_ != nullptr ? ncclGetLastError(comm_) : nullptr;
  const std::string message =
      absl::StrCat(kWhat, ": rank ", job().rank, " of ", job().world_size, ", ", what, ": ",
                   ncclGetErrorString(r), last != nullptr && *last != '\0' ? " (" : "",
                   last != nullptr ? last : "", last != nullptr && *last != '\0' ? ")" : "");
  if (r == ncclRemoteError || r == ncclSystemError) return absl::UnavailableError(message);
  return absl::InternalError(message);
}

void NcclCollective::AbortAndDrain() {
  if (comm_ != nullptr) {
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  if (stream_ != nullptr && cudaStreamSynchronize(stream_) != cudaSuccess) cudaGetLastError();
}

absl::Status NcclCollective::AwaitNccl(absl::Time deadline, const std::string& what) {
  auto timed_out = [&] {
    return absl::DeadlineExceededError(absl::StrCat(
        kWhat, ": rank ", job().rank, " of ", job().world_size, ", ", what,
        " did not complete before the deadline (a rank is not running, not in this call, or "
        "its link failed)"));
  };
  ncclResult_t state = AwaitCommState(comm_, deadline);
  if (state == ncclInProgress) return timed_out();
  RETURN_IF_ERROR(CommStatus(state, what));
  RETURN_IF_ERROR(cuda::CudaStatus(cudaEventRecord(done_, stream_), "event"));
  for (int spins = 0;; ++spins) {
    const cudaError_t e = cudaEventQuery(done_);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) {
      return cuda::CudaStatus(e, absl::StrCat(what, " on CUDA device ", device_index_));
    }
    // A peer that failed shows here while the kernels still wait for it.
    if (ncclResult_t r = ncclCommGetAsyncError(comm_, &state); r != ncclSuccess) state = r;
    RETURN_IF_ERROR(CommStatus(state, what));
    if (absl::Now() >= deadline) return timed_out();
    cuda::PollPause(spins);
  }
}

absl::Status NcclCollective::Connect(absl::Time deadline) {
  const uint32_t rank = job().rank;
  const uint32_t n = job().world_size;
  const std::string path = IdPath();
  const std::string where =
      absl::StrCat(kWhat, ": rank ", rank, " of ", n, ", rendezvous file ", path);
  ncclUniqueId id;
  if (rank == 0) {
    if (access(path.c_str(), F_OK) == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(where, " exists (left by an earlier run of job ", job().job_id,
                       " whose rendezvous failed? remove it, or use a fresh directory)"));
    }
    RETURN_IF_ERROR(CommStatus(ncclGetUniqueId(&id), "ncclGetUniqueId"));
    const std::string tmp = absl::StrCat(path, ".", getpid(), ".tmp");
    const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    bool written = fd >= 0 && write(fd, &id, sizeof(id)) == static_cast<ssize_t>(sizeof(id));
    const int error = errno;
    if (fd >= 0) written = close(fd) == 0 && written;
    if (!written || rename(tmp.c_str(), path.c_str()) != 0) {
      const int e = written ? errno : error;
      std::remove(tmp.c_str());
      return absl::FailedPreconditionError(
          absl::StrCat(where, ": cannot write it (", std::strerror(e),
                       "); the directory must be writable and shared by every rank"));
    }
  } else {
    for (;;) {
      if (ReadId(path, &id)) break;
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat(where,
                         ": rank 0 did not publish the NCCL id before the deadline (rank 0 is not "
                         "running, has not reached its first Step, or uses another rendezvous "
                         "directory)"));
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  absl::Status s = CreateCommunicator(id, deadline);
  // Past the communicator's creation every rank has read the id; after a
  // failure rank 0's file is of no use to anyone (a later run writes its
  // own). Either way rank 0 removes it.
  if (rank == 0) std::remove(path.c_str());
  return s;
}

absl::Status NcclCollective::CreateCommunicator(const ncclUniqueId& id, absl::Time deadline) {
  const uint32_t rank = job().rank;
  const uint32_t n = job().world_size;
  cuda::DeviceScope scope(device_index_);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so that every wait below has a deadline
  ncclComm_t comm = nullptr;
  const ncclResult_t r =
      ncclCommInitRankConfig(&comm, static_cast<int>(n), id, static_cast<int>(rank), &config);
  comm_ = comm;
  if (r != ncclSuccess && r != ncclInProgress) {
    absl::Status s = CommStatus(r, "ncclCommInitRankConfig");
    AbortAndDrain();
    return s;
  }
  const ncclResult_t state = AwaitCommState(comm_, deadline);
  if (state == ncclInProgress) {
    AbortAndDrain();
    return absl::DeadlineExceededError(absl::StrCat(
        kWhat, ": rank ", rank, " of ", n,
        ": not every rank joined the NCCL communicator before the deadline (a rank is not "
        "running or has not reached this call)"));
  }
  if (absl::Status s = CommStatus(state, "creating the communicator"); !s.ok()) {
    AbortAndDrain();
    return s;
  }
  return absl::OkStatus();
}

absl::Status NcclCollective::Exchange(absl::Time deadline) {
  absl::Status s = ReduceScatter(deadline);
  if (!s.ok()) AbortAndDrain();
  return s;
}

absl::Status NcclCollective::ReduceScatter(absl::Time deadline) {
  if (comm_ == nullptr) RETURN_IF_ERROR(Connect(deadline));
  cuda::DeviceScope scope(device_index_);
  const uint64_t pe = job().map->partition_elements();
  RETURN_IF_ERROR(CommStatus(
      ncclReduceScatter(acc_, acc_ + job().rank * pe, pe, ncclFloat32, ncclSum, comm_, stream_),
      "ncclReduceScatter"));
  RETURN_IF_ERROR(AwaitNccl(deadline, "the gradient reduce-scatter"));
  const uint64_t bytes = uint64_t{job().world_size - 1} * pe * sizeof(float);
  job().traffic->AddCollectiveSent(bytes);
  job().traffic->AddCollectiveReceived(bytes);
  return absl::OkStatus();
}

absl::StatusOr<const void*> NcclCollective::WireBucket(const FlatRange& bucket,
                                                       absl::Time deadline) {
  RETURN_IF_ERROR(device_->ToHost(acc_ + bucket.begin, DType::kFp32, host_.data(),
                                  plan().wire_dtype(), bucket.size(), deadline));
  return static_cast<const void*>(host_.data());
}

absl::Status NcclCollective::FetchOwn(const FlatRange& own, void* own_dst, DType dtype,
                                      const FetchRange& fetch_own, absl::Time deadline) {
  return FetchToDevice(*device_, host_.data(), host_.size() / DeviceCopier::kLanes, own,
                       DTypeSize(dtype), fetch_own, own_dst, [deadline] { return deadline; });
}

absl::Status NcclCollective::ExchangeGather(const FlatRange& range, void* dst, DType dtype,
                                            absl::Time deadline) {
  absl::Status s = Broadcast(range, dst, dtype, deadline);
  // Nothing writes `dst` once the call has returned.
  if (!s.ok()) AbortAndDrain();
  return s;
}

absl::Status NcclCollective::Broadcast(const FlatRange& range, void* dst, DType dtype,
                                       absl::Time deadline) {
  if (comm_ == nullptr) RETURN_IF_ERROR(Connect(deadline));
  cuda::DeviceScope scope(device_index_);
  const uint32_t n = job().world_size;
  const uint32_t p = job().rank;
  const size_t esize = DTypeSize(dtype);
  auto* bytes = static_cast<uint8_t*>(dst);
  const std::string what =
      absl::StrCat("the parameter all-gather of [", range.begin, ", ", range.end, ")");
  uint64_t sent = 0, received = 0;
  RETURN_IF_ERROR(CommStatus(ncclGroupStart(), "ncclGroupStart"));
  absl::Status status;
  for (uint32_t q = 0; q < n && status.ok(); ++q) {
    const FlatRange piece = job().map->UnpaddedPartition(q).Intersect(range);
    if (piece.empty()) continue;
    uint8_t* at = bytes + (piece.begin - range.begin) * esize;
    status = CommStatus(
        ncclBroadcast(at, at, piece.size(), NcclType(dtype), static_cast<int>(q), comm_, stream_),
        "ncclBroadcast");
    (q == p ? sent : received) += piece.size() * esize * (q == p ? n - 1 : 1);
  }
  if (absl::Status s = CommStatus(ncclGroupEnd(), "ncclGroupEnd"); status.ok()) status = s;
  if (status.ok()) status = AwaitNccl(deadline, what);
  if (status.ok()) {
    job().traffic->AddCollectiveSent(sent);
    job().traffic->AddCollectiveReceived(received);
  }
  return status;
}

}  // namespace zeroshard
