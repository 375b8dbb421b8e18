#include "client/daemon_reduce_collective.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/protocol.h"
#include "common/status_macros.h"
#include "common/stream_copy.h"

namespace zeroshard {

void ConvertElements(DType from, const void* src, DType to, void* dst, size_t n) {
  if (from == to) {
    // Non-temporal: skips reading the staging buffer's old contents in.
    StreamCopy(dst, src, n * DTypeSize(from));
  } else if (to == DType::kFp32) {
    ToFloat(from, src, static_cast<float*>(dst), n);
  } else if (from == DType::kFp32) {
    FromFloat(to, static_cast<const float*>(src), dst, n);
  } else {  // half to the other half, through fp32 in small blocks
    constexpr size_t kBlock = 1024;
    float tmp[kBlock];
    const auto* s = static_cast<const uint8_t*>(src);
    auto* d = static_cast<uint8_t*>(dst);
    for (size_t i = 0; i < n; i += kBlock) {
      const size_t m = std::min(kBlock, n - i);
      ToFloat(from, s + i * 2, tmp, m);
      FromFloat(to, tmp, d + i * 2, m);
    }
  }
}

DaemonReduceCollective::DaemonReduceCollective(const Options& options)
    : options_(options),
      buffer_bytes_(BucketPlan::StagingBytes(options.bucket_bytes, options.wire_dtype)),
      buffer_count_(options.staging_buffers) {}

absl::StatusOr<std::unique_ptr<DaemonReduceCollective>> DaemonReduceCollective::Create(
    const Options& options) {
  if (options.staging_buffers < 2 || options.staging_buffers > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "staging_buffers: must be in 2..1024, got ", options.staging_buffers));
  }
  if (options.sender_threads < 1 || options.sender_threads > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("sender_threads: must be in 1..64, got ", options.sender_threads));
  }
  if (BucketPlan::StagingBytes(options.bucket_bytes, options.wire_dtype) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket_bytes: too small, got ", options.bucket_bytes));
  }
  std::unique_ptr<DaemonReduceCollective> c(new DaemonReduceCollective(options));
  // Pinnable (whole pages): CUDA copies may land in it.
  c->storage_bytes_ = c->buffer_bytes_ * c->buffer_count_;
  if (options.push_memories != nullptr) {
    if (auto shared = options.push_memories->Allocate(c->storage_bytes_); shared.ok()) {
      c->push_memory_ = *std::move(shared);
      c->storage_ = static_cast<uint8_t*>(c->push_memory_->data());
    }
  }
  if (c->storage_ == nullptr) {
    // Plain memory without push memories, or where the system gives no
    // memfd (the pushes are Put).
    c->heap_ = PinnableBuffer(c->storage_bytes_);
    c->storage_ = c->heap_.data();
  }
  if (c->storage_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "allocating the ", c->storage_bytes_, "-byte gradient staging pool"));
  }
  {
    absl::MutexLock lock(&c->mu_);
    for (int i = static_cast<int>(c->buffer_count_) - 1; i >= 0; --i) c->free_.push_back(i);
  }
  c->senders_ = std::make_unique<Executor>(options.sender_threads);
  return c;
}

DaemonReduceCollective::~DaemonReduceCollective() {
  senders_.reset();
  if (pinned_) job_.device->Unpin(storage_);
}

absl::Status DaemonReduceCollective::Bind(const CollectiveJob& job) {
  if (bound_.load())
    return absl::FailedPreconditionError("the collective is already bound to a job");
  if (job.layout == nullptr || job.map == nullptr || job.traffic == nullptr) {
    return absl::InvalidArgumentError("CollectiveJob: layout, map and traffic are required");
  }
  if (job.bucket_bytes != options_.bucket_bytes || job.wire_dtype != options_.wire_dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("the staging pool was sized for bucket_bytes ", options_.bucket_bytes, " of ",
                     DTypeName(options_.wire_dtype), ", the job uses ", job.bucket_bytes, " of ",
                     DTypeName(job.wire_dtype)));
  }
  if (job.daemons.size() != job.map->num_daemons()) {
    return absl::InvalidArgumentError(absl::StrCat("CollectiveJob: ", job.daemons.size(),
                                                   " data paths for ", job.map->num_daemons(),
                                                   " daemons"));
  }
  if (job.micro_batches < 1) {
    return absl::InvalidArgumentError("CollectiveJob: micro_batches must be >= 1");
  }
  absl::StatusOr<BucketPlan> plan =
      BucketPlan::Create(*job.layout, *job.map, job.bucket_bytes, job.wire_dtype,
                         BucketCut::kDaemon, /*at_layers=*/job.stage == 3);
  if (!plan.ok()) return plan.status();
  // Device gradients are copied into the staging pool by DMA: pinned once.
  if (job.device != nullptr) {
    if (absl::Status s = job.device->Pin(storage_, storage_bytes_); !s.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("pinning the gradient staging pool for CUDA copies: ", s.message()));
    }
    pinned_ = true;
  }
  job_ = job;
  plan_ = *std::move(plan);
  {
    absl::MutexLock lock(&mu_);
    sent_.assign(plan_.buckets().size() * job.micro_batches, 0);
    delivered_.assign(sent_.size(), 0);
    queued_.assign(job.daemons.size(), {});
    in_flight_to_.assign(job.daemons.size(), 0);
  }
  bound_.store(true, std::memory_order_release);
  return absl::OkStatus();
}

uint32_t DaemonReduceCollective::peak_buffers_in_use() const {
  absl::MutexLock lock(&mu_);
  return peak_in_use_;
}

std::string DaemonReduceCollective::DescribeBucket(uint64_t key) const {
  const size_t nb = plan_.buckets().size();
  const Bucket& b = plan_.buckets()[key % nb];
  std::string s = absl::StrCat("bucket [", b.range.begin, ", ", b.range.end, ") of daemon ",
                               job_.daemons[b.daemon]->address());
  if (job_.micro_batches > 1) absl::StrAppend(&s, ", micro-batch ", key / nb);
  return s;
}

absl::StatusOr<int> DaemonReduceCollective::AcquireBuffer(absl::Time deadline,
                                                          int own_pushers) {
  auto ready = [this, own_pushers]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !free_.empty() || (staged_in_flight_ == 0 && pushers_ <= own_pushers);
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
    std::string waiting;
    for (size_t d = 0; d < in_flight_to_.size(); ++d) {
      if (in_flight_to_[d] == 0) continue;
      absl::StrAppend(&waiting, waiting.empty() ? "" : ", ", in_flight_to_[d], " to daemon ",
                      job_.daemons[d]->address());
    }
    return absl::DeadlineExceededError(
        absl::StrCat("PushGradients: no staging buffer became free before the deadline (",
                     buffer_count_, " buffers of ", buffer_bytes_, " bytes, ", staged_in_flight_,
                     " in flight", waiting.empty() ? "" : ": buckets unanswered ", waiting, ")"));
  }
  if (free_.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "PushGradients: all ", buffer_count_, " staging buffers hold partly pushed buckets and ",
        "none is in flight; push gradient ranges in flat order or raise staging_buffers"));
  }
  const int b = free_.back();
  free_.pop_back();
  peak_in_use_ = std::max<uint32_t>(peak_in_use_, buffer_count_ - free_.size());
  return b;
}

absl::StatusOr<DaemonReduceCollective::Active*> DaemonReduceCollective::StartBucket(
    uint64_t key, size_t index, absl::Time deadline, int own_pushers) {
  if (Delivered(key)) {
    if (sent_[key]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "PushGradients: ", DescribeBucket(key), " was already pushed for step ", step_));
    }
    return &active_[key];  // accounted only: nothing to copy or send
  }
  absl::StatusOr<int> b = AcquireBuffer(deadline, own_pushers);
  if (!b.ok()) return b.status();
  // Another thread may have started the bucket while this one waited.
  auto it = active_.find(key);
  if (it != active_.end() || sent_[key]) {
    free_.push_back(*b);
    if (it != active_.end()) return &it->second;
    return absl::InvalidArgumentError(
        absl::StrCat("PushGradients: ", DescribeBucket(key), " was already pushed for step ",
                     step_));
  }
  Active& a = active_[key];
  a.buffer = *b;
  const Bucket& bucket = plan_.buckets()[index];
  const size_t esize = DTypeSize(plan_.wire_dtype());
  uint8_t* base = buffer(a.buffer);
  plan_.ForEachGapSegment(bucket.range, [&](const FlatRange& g) {
    std::memset(base + (g.begin - bucket.range.begin) * esize, 0, g.size() * esize);
  });
  return &a;
}

absl::Status DaemonReduceCollective::CheckArguments(uint32_t micro_batch,
                                                    const FlatRange& range,
                                                    const void* grads) const {
  if (!bound_.load(std::memory_order_acquire)) {
    return absl::FailedPreconditionError("PushGradients before RegisterModel");
  }
  if (micro_batch >= job_.micro_batches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "micro_batch: must be < micro_batches (", job_.micro_batches, "), got ", micro_batch));
  }
  if (range.empty() || range.end > plan_.total_elements()) {
    return absl::InvalidArgumentError(
        absl::StrCat("range: [", range.begin, ", ", range.end, ") is empty or outside the ",
                     "flat space [0, ", plan_.total_elements(), ")"));
  }
  if (grads == nullptr) return absl::InvalidArgumentError("grads: null");
  return absl::OkStatus();
}

namespace {

// The most pulled pushes one PushGradients call announces (each a chunk of
// its stream and an entry the daemon checks and holds).
constexpr size_t kMaxPullsPerCall = 64;

bool Overlaps(const std::vector<FlatRange>& written, const FlatRange& r) {
  for (const FlatRange& w : written) {
    if (!w.Intersect(r).empty()) return true;
  }
  return false;
}

}  // namespace

absl::Status DaemonReduceCollective::BeginReduce(const Contribution& c, size_t first,
                                                 size_t last) {
  absl::MutexLock lock(&mu_);
  if (step_ != c.step) {
    if (step_ != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "PushGradients for step ", c.step, " while pushes of step ", step_,
          " are pending; call Step first"));
    }
    step_ = c.step;
  }
  if (delivered_step_ != c.step) {  // what earlier attempts delivered was for another step
    std::fill(delivered_.begin(), delivered_.end(), 0);
    delivered_step_ = c.step;
  }
  for (size_t i = first; i < last; ++i) {
    const uint64_t key = KeyOf(c.micro_batch, i);
    const FlatRange clip = plan_.buckets()[i].range.Intersect(c.range);
    auto it = active_.find(key);
    if (sent_[key] || (it != active_.end() && Overlaps(it->second.written, clip))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "PushGradients: range [", clip.begin, ", ", clip.end, ") of ", DescribeBucket(key),
          " was already pushed for step ", c.step));
    }
  }
  ++pushers_;
  return absl::OkStatus();
}

absl::Status DaemonReduceCollective::MarkNoGradient(uint64_t step, uint32_t micro_batch,
                                                    absl::Span<const uint32_t> tensors) {
  RETURN_IF_ERROR(
      CheckMarks(job_, bound_.load(std::memory_order_acquire), micro_batch, tensors));
  const uint64_t count = job_.layout->tensors().size();
  absl::MutexLock lock(&mu_);
  if (no_grad_step_ != step) {
    no_grad_.clear();
    no_grad_step_ = step;
  }
  for (uint32_t t : tensors) no_grad_.insert(micro_batch * count + t);
  return absl::OkStatus();
}

std::vector<uint32_t> DaemonReduceCollective::NoGradTensorsOf(uint64_t key) const {
  std::vector<uint32_t> out;
  if (no_grad_.empty()) return out;
  const size_t nb = plan_.buckets().size();
  const uint64_t count = job_.layout->tensors().size();
  const uint64_t micro_batch = key / nb;
  const auto [first, last] = job_.layout->TensorsIn(plan_.buckets()[key % nb].range);
  for (size_t t = first; t < last; ++t) {
    if (no_grad_.contains(micro_batch * count + t)) out.push_back(static_cast<uint32_t>(t));
  }
  return out;
}

absl::StatusOr<PushTicket> DaemonReduceCollective::Reduce(uint64_t step, uint32_t micro_batch,
                                                          const FlatRange& range, const void* grads,
                                                          DType dtype, BufferUse use,
                                                          MemoryKind memory, absl::Time deadline) {
  if (absl::Status s = CheckArguments(micro_batch, range, grads); !s.ok()) return s;
  if (memory == MemoryKind::kCudaDevice) {
    if (job_.device == nullptr) {
      return absl::FailedPreconditionError(
          "PushGradients: grads in CUDA device memory, but the client has no device "
          "(ClientConfig.cuda_device is -1)");
    }
    const DType wire = plan_.wire_dtype();
    if (dtype != wire && dtype != DType::kFp32 && wire != DType::kFp32) {
      return absl::InvalidArgumentError(absl::StrCat(
          "PushGradients: device gradients of ", DTypeName(dtype), " for a ", DTypeName(wire),
          " job: the device casts fp32 <-> bf16/fp16 only; push fp32 or ", DTypeName(wire)));
    }
    if (absl::Status s = job_.device->CheckDevicePointer(grads, range.size() * DTypeSize(dtype),
                                                         "PushGradients: grads");
        !s.ok()) {
      return s;
    }
    use = BufferUse::kCopy;  // device bytes reach the daemons from the staging pool
  }
  const Contribution c{step,  micro_batch, range,  static_cast<const uint8_t*>(grads),
                       dtype, use,         memory, deadline};
  const auto [first, last] = plan_.Overlapping(range);
  if (absl::Status s = BeginReduce(c, first, last); !s.ok()) return s;
  auto ticket = std::make_shared<CountDown>(0);
  // Borrowed buckets are reserved (marked sent) in the loop and handed to
  // the senders only once the whole call has succeeded: a call that fails
  // leaves nothing reading `grads` behind it.
  std::vector<Borrowed> borrowed;
  absl::Status status;
  for (size_t i = first; i < last && status.ok(); ++i) {
    status = ContributeBucket(c, i, ticket, &borrowed);
  }
  return EndReduce(status, std::move(ticket), borrowed);
}

absl::Status DaemonReduceCollective::ContributeBucket(const Contribution& c, size_t index,
                                                      const std::shared_ptr<CountDown>& ticket,
                                                      std::vector<Borrowed>* borrowed) {
  const Bucket& bucket = plan_.buckets()[index];
  const uint64_t key = KeyOf(c.micro_batch, index);
  const FlatRange clip = bucket.range.Intersect(c.range);
  const size_t src_size = DTypeSize(c.dtype);
  const uint8_t* src = c.grads + (clip.begin - c.range.begin) * src_size;
  auto already = [&] {
    return absl::InvalidArgumentError(absl::StrCat("PushGradients: range [", clip.begin, ", ",
                                                   clip.end, ") of ", DescribeBucket(key),
                                                   " was already pushed for step ", c.step));
  };
  uint8_t* base = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = active_.find(key);
    // A borrowed buffer that holds a whole gap-free bucket in the wire
    // dtype is sent from where it is.
    if (c.use == BufferUse::kBorrow && it == active_.end() && c.dtype == plan_.wire_dtype() &&
        clip == bucket.range && bucket.real_elements == bucket.range.size()) {
      if (sent_[key]) return already();
      sent_[key] = 1;
      borrowed->push_back({key, src, Delivered(key)});
      return absl::OkStatus();
    }
    Active* a = nullptr;
    if (it != active_.end()) {
      a = &it->second;
    } else {
      absl::StatusOr<Active*> started = StartBucket(key, index, c.deadline, 1);
      if (!started.ok()) return started.status();
      a = *started;
    }
    if (Overlaps(a->written, clip)) return already();
    a->written.push_back(clip);
    ++a->writers;
    ticket->Add(1);
    a->tickets.push_back(ticket);
    if (a->buffer >= 0) base = buffer(a->buffer);
  }
  // Copy outside the lock: the claimed range is this thread's alone.
  uint64_t real = 0;
  const size_t wire_size = DTypeSize(plan_.wire_dtype());
  absl::Status copied;
  plan_.ForEachRealSegment(clip, [&](const FlatRange& s) {
    if (base != nullptr && copied.ok()) {
      const uint8_t* from = src + (s.begin - clip.begin) * src_size;
      uint8_t* to = base + (s.begin - bucket.range.begin) * wire_size;
      if (c.memory == MemoryKind::kCudaDevice) {
        copied = job_.device->ToHost(from, c.dtype, to, plan_.wire_dtype(), s.size(), c.deadline);
      } else {
        ConvertElements(c.dtype, from, plan_.wire_dtype(), to, s.size());
      }
    }
    real += s.size();
  });
  absl::MutexLock lock(&mu_);
  if (!copied.ok()) {
    AbandonWrite(key, clip, ticket);
    return absl::Status(copied.code(), absl::StrCat("PushGradients: copying ", DescribeBucket(key),
                                                    " from the device: ", copied.message()));
  }
  EndWrite(key, real);
  return absl::OkStatus();
}

void DaemonReduceCollective::AbandonWrite(uint64_t key, const FlatRange& clip,
                                          const std::shared_ptr<CountDown>& ticket) {
  Active& a = active_.find(key)->second;
  auto w = std::find(a.written.begin(), a.written.end(), clip);
  if (w != a.written.end()) a.written.erase(w);
  auto t = std::find(a.tickets.begin(), a.tickets.end(), ticket);
  if (t != a.tickets.end()) a.tickets.erase(t);
  ticket->Done(absl::CancelledError("the push failed"));
  --a.writers;
  // This bucket's part of the range stays unwritten (a later push may fill
  // it); what the call wrote into earlier buckets stays written.
}

void DaemonReduceCollective::EndWrite(uint64_t key, uint64_t real) {
  auto it = active_.find(key);
  Active& a = it->second;
  a.written_real += real;
  --a.writers;
  if (a.writers == 0 &&
      a.written_real == plan_.buckets()[key % plan_.buckets().size()].real_elements) {
    Active done = std::move(a);
    active_.erase(it);
    Send(key, done.buffer, done.buffer >= 0 ? buffer(done.buffer) : nullptr,
         std::move(done.tickets));
  }
}

absl::StatusOr<PushTicket> DaemonReduceCollective::EndReduce(
    const absl::Status& status, std::shared_ptr<CountDown> ticket,
    const std::vector<Borrowed>& borrowed) {
  absl::MutexLock lock(&mu_);
  --pushers_;
  for (const Borrowed& b : borrowed) {
    if (!status.ok()) {
      sent_[b.key] = 0;
    } else if (!b.delivered) {
      ticket->Add(1);
      Dispatch(b.key, /*buffer_index=*/-1, b.data, {ticket});
    }
  }
  if (!status.ok()) return status;
  return PushTicket(std::move(ticket));
}

void DaemonReduceCollective::Send(uint64_t key, int buffer_index, const uint8_t* data,
                                  std::vector<std::shared_ptr<CountDown>> tickets) {
  sent_[key] = 1;
  if (Delivered(key)) {  // confirmed by an earlier attempt of this step
    for (const auto& t : tickets) t->Done();
    if (buffer_index >= 0) free_.push_back(buffer_index);
    return;
  }
  Dispatch(key, buffer_index, data, std::move(tickets));
}

void DaemonReduceCollective::Dispatch(uint64_t key, int buffer_index, const uint8_t* data,
                                      std::vector<std::shared_ptr<CountDown>> tickets) {
  ++in_flight_;
  if (buffer_index >= 0) ++staged_in_flight_;
  const uint32_t daemon = plan_.buckets()[key % plan_.buckets().size()].daemon;
  ++in_flight_to_[daemon];
  queued_[daemon].push_back({step_, attempt_, key, buffer_index, data, std::move(tickets)});
  senders_->Submit([this, daemon] { RunSends(daemon); });
}

void DaemonReduceCollective::RunSends(uint32_t daemon) {
  const size_t nb = plan_.buckets().size();
  const uint64_t wire = DTypeSize(plan_.wire_dtype());
  std::vector<Queued> batch;
  std::vector<std::vector<uint32_t>> no_grad;
  {
    absl::MutexLock lock(&mu_);
    std::deque<Queued>& queue = queued_[daemon];
    uint64_t bytes = 0;
    // Borrowed pulls from one push memory go in one call, however many: the
    // daemon reads their bytes where they are, and holds each until its
    // range is complete, so one announcement per rank starts a range's sum
    // sooner and costs the daemon's cores one RPC instead of one per
    // bucket. Buckets in the staging pool go as before: each answer frees
    // its buffer for the next copy.
    DataPath::PullMemory pulled;  // the one the batch's first push is pulled from
    while (!queue.empty()) {
      const Queued& next = queue.front();
      const uint64_t payload = plan_.buckets()[next.key % nb].range.size() * wire;
      // Counted as the daemon counts a stream's bytes (common/protocol.h).
      const uint64_t b = payload + kPushChunkOverheadBytes;
      if (!batch.empty()) {
        if (next.step != batch[0].step || next.attempt != batch[0].attempt) break;
        const bool pulled_too = next.buffer_index < 0 && pulled.Holds(next.data, payload) &&
                                batch.size() < kMaxPullsPerCall;
        if (!pulled_too && (pulled.serial != 0 || bytes + b > options_.bucket_bytes)) break;
      } else if (next.buffer_index < 0) {
        pulled = job_.daemons[daemon]->PullMemoryOf(next.data, payload);
      }
      bytes += b;
      batch.push_back(std::move(queue.front()));
      queue.pop_front();
      no_grad.push_back(no_grad_step_ == batch.back().step ? NoGradTensorsOf(batch.back().key)
                                                           : std::vector<uint32_t>());
    }
  }
  if (batch.empty()) return;
  std::vector<GradientPush> pushes(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const Bucket& bucket = plan_.buckets()[batch[i].key % nb];
    GradientPush& push = pushes[i];
    push.job_id = job_.job_id;
    push.step = batch[i].step;
    push.rank = job_.rank;
    push.incarnation = job_.incarnation;
    push.micro_batch = static_cast<uint32_t>(batch[i].key / nb);
    push.micro_batches = job_.micro_batches;
    push.range = bucket.range;
    push.dtype = plan_.wire_dtype();
    push.data = batch[i].data;
    push.no_grad_tensors = std::move(no_grad[i]);
  }
  const std::vector<absl::StatusOr<uint64_t>> sent =
      job_.daemons[daemon]->PushGradients(pushes, absl::Now() + job_.rpc_timeout);
  for (size_t i = 0; i < batch.size(); ++i) {
    if (sent[i].ok()) job_.traffic->AddPush(*sent[i]);
    for (const auto& t : batch[i].tickets) t->Done(sent[i].status());
  }
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < batch.size(); ++i) {
    const Queued& q = batch[i];
    if (q.buffer_index >= 0) {
      free_.push_back(q.buffer_index);
      --staged_in_flight_;
    }
    --in_flight_;
    --in_flight_to_[daemon];
    if (sent[i].ok() && delivered_step_ == q.step) delivered_[q.key] = 1;
    // A send of an abandoned attempt does not fail the next one.
    if (!sent[i].ok() && q.attempt == attempt_ && error_.ok()) error_ = sent[i].status();
  }
}

void DaemonReduceCollective::ResetStep(const absl::Status& reason) {
  for (auto& [key, a] : active_) {
    for (const auto& t : a.tickets) t->Done(reason);
    if (a.buffer >= 0) free_.push_back(a.buffer);
  }
  active_.clear();
  std::fill(sent_.begin(), sent_.end(), 0);
  error_ = absl::OkStatus();
  ++attempt_;
  step_ = 0;
}

absl::Status DaemonReduceCollective::SendGapBuckets(absl::Time deadline) {
  const size_t nb = plan_.buckets().size();
  // Buckets without tensor elements carry only zeros; nobody pushes them.
  for (uint64_t key = 0; key < sent_.size() && error_.ok(); ++key) {
    const size_t i = key % nb;
    if (sent_[key] || Delivered(key) || plan_.buckets()[i].real_elements != 0) continue;
    absl::StatusOr<Active*> a = StartBucket(key, i, deadline, 0);
    if (!a.ok()) return a.status();
    Active done = std::move(**a);
    active_.erase(key);
    Send(key, done.buffer, done.buffer >= 0 ? buffer(done.buffer) : nullptr,
         std::move(done.tickets));
  }
  return absl::OkStatus();
}

absl::Status DaemonReduceCollective::IncompleteBuckets(uint64_t step) {
  const size_t nb = plan_.buckets().size();
  if (!active_.empty()) {
    auto it = std::min_element(active_.begin(), active_.end(),
                               [](const auto& a, const auto& b) { return a.first < b.first; });
    return absl::FailedPreconditionError(absl::StrCat(
        "Step ", step, ": rank ", job_.rank, " pushed only ", it->second.written_real, " of ",
        plan_.buckets()[it->first % nb].real_elements, " tensor elements of ",
        DescribeBucket(it->first)));
  }
  uint64_t done = 0, missing = sent_.size();
  for (uint64_t key = 0; key < sent_.size(); ++key) {
    if (sent_[key] || Delivered(key)) {
      ++done;
    } else if (missing == sent_.size()) {
      missing = key;
    }
  }
  if (missing == sent_.size()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "Step ", step, ": rank ", job_.rank, " pushed ", done, " of ", sent_.size(),
      " gradient buckets; nothing was pushed for ", DescribeBucket(missing)));
}

void DaemonReduceCollective::DropDeliveredActive() {
  for (auto it = active_.begin(); it != active_.end();) {
    if (!Delivered(it->first)) {
      ++it;
      continue;
    }
    for (const auto& t : it->second.tickets) t->Done();
    if (it->second.buffer >= 0) free_.push_back(it->second.buffer);
    active_.erase(it++);
  }
}

absl::Status DaemonReduceCollective::Finish(uint64_t step, absl::Time deadline) {
  if (!bound_.load(std::memory_order_acquire)) {
    return absl::FailedPreconditionError("Step before RegisterModel");
  }
  absl::MutexLock lock(&mu_);
  if (step_ != 0 && step_ != step) {
    return absl::InternalError(
        absl::StrCat("Finish(", step, ") while holding pushes of step ", step_));
  }
  step_ = step;
  if (delivered_step_ != step) {
    std::fill(delivered_.begin(), delivered_.end(), 0);
    delivered_step_ = step;
  }
  auto no_pushers = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pushers_ == 0; };
  if (!mu_.AwaitWithDeadline(absl::Condition(&no_pushers), deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("Step ", step, ": PushGradients calls still running at the deadline"));
  }
  // A retry need not push again what an earlier attempt delivered, in whole
  // or in part. A partly pushed bucket is the caller's mistake: report it
  // first.
  DropDeliveredActive();
  absl::Status status = active_.empty() ? SendGapBuckets(deadline) : IncompleteBuckets(step);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  if (!mu_.AwaitWithDeadline(absl::Condition(&idle), deadline)) {
    status = absl::DeadlineExceededError(absl::StrCat(
        "Step ", step, ": ", in_flight_, " gradient bucket(s) still in flight at the deadline"));
  }
  if (status.ok()) status = error_;
  if (status.ok()) status = IncompleteBuckets(step);
  ResetStep(status.ok() ? absl::OkStatus()
                        : absl::AbortedError(absl::StrCat("step ", step, " failed: ",
                                                          status.message())));
  return status;
}

}  // namespace zeroshard
