#include "client/ucx_data_path.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "client/rpc.h"

namespace zeroshard {
namespace {

constexpr int kStagingSlots = 2;

transport::RegionDescriptor ToDescriptor(const v1::RemoteRegion& r) {
  transport::RegionDescriptor d;
  d.address = r.address();
  d.length = r.length();
  d.rkey = r.rkey();
  return d;
}

}  // namespace

UcxDataPath::UcxDataPath(std::string address, std::shared_ptr<grpc::Channel> channel,
                         std::shared_ptr<transport::Transport> transport, int connections)
    : transport_(std::move(transport)),
      fallback_(std::move(address), std::move(channel)),
      connections_(std::max(1, connections)),
      slot_busy_(kStagingSlots, false) {}

UcxDataPath::~UcxDataPath() = default;

absl::StatusOr<const UcxDataPath::Endpoint*> UcxDataPath::GetEndpoint(const std::string& job_id,
                                                                     uint32_t rank,
                                                                     absl::Time deadline) {
  const Endpoint* ready = ready_.load(std::memory_order_acquire);
  if (ready == nullptr) {
    absl::MutexLock lock(&setup_mu_);
    if (endpoint_ == nullptr) {
      v1::ExchangeEndpointRequest req;
      req.set_job_id(job_id);
      req.set_rank(rank);
      req.set_transport(v1::TRANSPORT_KIND_UCX);
      req.set_worker_address(transport_->LocalAddress());
      v1::ExchangeEndpointResponse resp;
      grpc::ClientContext context;
      SetDeadline(&context, deadline);
      const grpc::Status status = fallback_.stub()->ExchangeEndpoint(&context, req, &resp);
      if (!status.ok()) return DaemonError(status, address(), "ExchangeEndpoint");
      auto endpoint = std::make_unique<Endpoint>();
      endpoint->job_id = job_id;
      bool has_staging = false, has_master = false;
      for (const v1::RemoteRegion& r : resp.regions()) {
        const FlatRange range{r.range().begin(), r.range().end()};
        if (r.purpose() == "grad_staging") {
          endpoint->staging = ToDescriptor(r);
          endpoint->slot_bytes = r.length() / kStagingSlots;
          has_staging = true;
        } else if (r.purpose() == "param_master") {
          endpoint->master = ToDescriptor(r);
          endpoint->master_range = range;
          has_master = r.length() >= range.size() * sizeof(float);
        } else if (r.purpose() == "param_half") {
          endpoint->half = ToDescriptor(r);
          endpoint->half_range = range;
          endpoint->has_half = r.length() >= range.size() * sizeof(uint16_t);
        }
      }
      if (!has_staging || !has_master) {
        return absl::DataLossError(absl::StrCat(
            "daemon ", address(), ": ExchangeEndpoint: the reply lacks a grad_staging or a ",
            "well-formed param_master region"));
      }
      // The transport hands connections to its progress threads in turn;
      // opening this daemon's connections back to back, with no other data
      // path's in between, puts them on different threads.
      static absl::Mutex* const connect_mu = new absl::Mutex;
      absl::MutexLock connect_lock(connect_mu);
      for (int i = 0; i < connections_; ++i) {
        absl::StatusOr<std::unique_ptr<transport::Connection>> connection =
            transport_->Connect(resp.worker_address(), deadline);
        if (!connection.ok()) {
          return absl::Status(connection.status().code(),
                              absl::StrCat("daemon ", address(), ": UCX connect: ",
                                           connection.status().message()));
        }
        endpoint->connections.push_back(*std::move(connection));
      }
      endpoint_ = std::move(endpoint);
      ready_.store(endpoint_.get(), std::memory_order_release);
    }
    ready = endpoint_.get();
  }
  if (ready->job_id != job_id) {
    return absl::InvalidArgumentError(absl::StrCat("job_id: this data path serves job ",
                                                   ready->job_id, ", got ", job_id));
  }
  return ready;
}

absl::StatusOr<int> UcxDataPath::AcquireSlot(absl::Time deadline) {
  absl::MutexLock lock(&slot_mu_);
  auto free_slot = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(slot_mu_) {
    return std::find(slot_busy_.begin(), slot_busy_.end(), false) != slot_busy_.end();
  };
  if (!slot_mu_.AwaitWithDeadline(absl::Condition(&free_slot), deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("daemon ", address(), ": no staging slot became free in time"));
  }
  const int slot =
      static_cast<int>(std::find(slot_busy_.begin(), slot_busy_.end(), false) - slot_busy_.begin());
  slot_busy_[slot] = true;
  return slot;
}

void UcxDataPath::ReleaseSlot(int slot) {
  absl::MutexLock lock(&slot_mu_);
  slot_busy_[slot] = false;
}

absl::Status UcxDataPath::Finish(transport::Completion& completion, absl::Time deadline,
                                 absl::FunctionRef<std::string()> what) {
  absl::Status s = completion.Wait(deadline);
  if (absl::IsDeadlineExceeded(s)) {
    completion.Abort();
    // The caller's buffer (a staging buffer, or a trainer's borrowed
    // gradients) is in use until the transport lets go of it, which an
    // aborted operation does promptly; returning earlier would let the
    // caller free memory the transport still reads or writes.
    while (absl::IsDeadlineExceeded(
        completion.Wait(absl::Now() + transport::Completion::kDestroyWait))) {
      std::fprintf(stderr,
                   "zeroshard client: daemon %s: %s: the transport still holds the buffer "
                   "after an abort; waiting\n",
                   address().c_str(), what().c_str());
    }
  }
  if (s.ok()) return s;
  return absl::Status(s.code(),
                      absl::StrCat("daemon ", address(), ": ", what(), ": ", s.message()));
}

absl::StatusOr<uint64_t> UcxDataPath::PushGradient(const GradientPush& push, absl::Time deadline) {
  const uint64_t bytes = push.range.size() * DTypeSize(push.dtype);
  absl::StatusOr<const Endpoint*> ep = GetEndpoint(push.job_id, push.rank, deadline);
  if (!ep.ok()) return ep.status();
  // A chunk larger than a slot (a bucket wider in fp32 than in the wire
  // type) goes inline.
  if (bytes > (*ep)->slot_bytes) return fallback_.PushGradient(push, deadline);
  absl::StatusOr<int> slot = AcquireSlot(deadline);
  if (!slot.ok()) return slot.status();
  const uint64_t offset = static_cast<uint64_t>(*slot) * (*ep)->slot_bytes;
  absl::Status s;
  {
    transport::Completion put =
        (*ep)->connections[0]->Put(push.data, bytes, (*ep)->staging, offset);
    s = Finish(put, deadline, [&] { return DescribePush(push) + ": Put"; });
  }
  if (s.ok()) {
    v1::GradientChunk chunk = GradientChunkHeader(push);
    // No checksum: UCX delivers the bytes intact (TCP checksums them, shared
    // memory cannot corrupt them), and a CRC pass on each side would cost
    // two more sweeps over the gradient.
    chunk.set_staged(true);
    chunk.set_staging_offset(offset);
    // The daemon reads the slot until the RPC returns.
    s = SendGradientChunk(fallback_.stub(), chunk, push, deadline, address());
  }
  ReleaseSlot(*slot);
  if (!s.ok()) return s;
  return bytes;
}

absl::StatusOr<uint64_t> UcxDataPath::InitParameters(const ParameterUpload& upload,
                                                     absl::Time deadline) {
  return fallback_.InitParameters(upload, deadline);
}

absl::StatusOr<uint64_t> UcxDataPath::Gather(const GatherRequestSpec& request, void* dst,
                                             absl::Time deadline) {
  absl::StatusOr<const Endpoint*> ep = GetEndpoint(request.job_id, request.rank, deadline);
  if (!ep.ok()) return ep.status();
  // The daemon validates the request and waits for the commit.
  if (absl::Status s = fallback_.AwaitCommitted(request, deadline); !s.ok()) return s;
  // Fp32 comes from the masters; the job's half precision from its copy.
  const bool half = request.dtype != DType::kFp32;
  if (half && !(*ep)->has_half) {
    return absl::InvalidArgumentError(absl::StrCat("daemon ", address(), ": ",
                                                   DescribeGather(request), ": dtype ",
                                                   DTypeName(request.dtype),
                                                   " is not served by this job"));
  }
  const transport::RegionDescriptor& region = half ? (*ep)->half : (*ep)->master;
  const FlatRange& held = half ? (*ep)->half_range : (*ep)->master_range;
  if (!held.Contains(request.range)) {
    return absl::DataLossError(absl::StrCat("daemon ", address(), ": ", DescribeGather(request),
                                            ": outside the region's range [", held.begin, ", ",
                                            held.end, ")"));
  }
  const size_t esize = DTypeSize(request.dtype);
  const uint64_t bytes = request.range.size() * esize;
  const Endpoint& e = **ep;
  transport::Connection& connection =
      *e.connections[e.next_get.fetch_add(1, std::memory_order_relaxed) % e.connections.size()];
  transport::Completion get =
      connection.Get(dst, bytes, region, (request.range.begin - held.begin) * esize);
  absl::Status s = Finish(get, deadline, [&] { return DescribeGather(request) + ": Get"; });
  if (!s.ok()) return s;
  return bytes;
}

}  // namespace zeroshard
