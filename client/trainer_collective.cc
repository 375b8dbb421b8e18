#include "client/trainer_collective.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace zeroshard {

namespace {

// `what` of `call` in `given` memory, for a collective that takes `taken`.
absl::Status WrongMemory(const char* call, const char* what, MemoryKind given, MemoryKind taken) {
  return absl::FailedPreconditionError(absl::StrCat(
      call, ": ", what, " in ", MemoryKindName(given),
      " memory, but this trainer collective takes ", MemoryKindName(taken), " memory only (",
      taken == MemoryKind::kHost ? "copy the buffer to the host first"
                                 : "use a client with ClientConfig.cuda_device and device buffers",
      ")"));
}

}  // namespace

uint64_t TrainerCollective::staging_bytes() const {
  return bound_.load(std::memory_order_acquire) ? allocated_bytes() : 0;
}

absl::Status TrainerCollective::Bind(const CollectiveJob& job) {
  if (bound_.load()) {
    return absl::FailedPreconditionError("the collective is already bound to a job");
  }
  if (job.layout == nullptr || job.map == nullptr || job.traffic == nullptr) {
    return absl::InvalidArgumentError("CollectiveJob: layout, map and traffic are required");
  }
  if (job.daemons.size() != job.map->num_daemons()) {
    return absl::InvalidArgumentError(absl::StrCat("CollectiveJob: ", job.daemons.size(),
                                                   " data paths for ", job.map->num_daemons(),
                                                   " daemons"));
  }
  if (job.world_size != job.map->world_size() || job.rank >= job.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("CollectiveJob: rank ", job.rank,
                                                   " of world_size ", job.world_size,
                                                   " for a map of ", job.map->world_size()));
  }
  if (job.micro_batches < 1) {
    return absl::InvalidArgumentError("CollectiveJob: micro_batches must be >= 1");
  }
  ASSIGN_OR_RETURN(BucketPlan plan, BucketPlan::Create(*job.layout, *job.map, job.bucket_bytes,
                                                       job.wire_dtype, BucketCut::kPartition));
  RETURN_IF_ERROR(Allocate(job, plan));
  std::vector<size_t> my_buckets;
  for (size_t i = 0; i < plan.buckets().size(); ++i) {
    if (plan.buckets()[i].partition == job.rank) my_buckets.push_back(i);
  }
  job_ = job;
  plan_ = std::move(plan);
  real_elements_ = plan_.RealElements({0, plan_.total_elements()});
  my_buckets_ = std::move(my_buckets);
  {
    absl::MutexLock lock(&mu_);
    confirmed_.assign(my_buckets_.size(), 0);
  }
  bound_.store(true, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status TrainerCollective::Broken() const {
  if (broken_.ok()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      what_, " failed earlier and cannot continue (restart the ranks): ", broken_.message()));
}

absl::Status TrainerCollective::CheckArguments(uint32_t micro_batch, const FlatRange& range,
                                               const void* grads, DType dtype,
                                               MemoryKind memory) const {
  if (memory != memory_kind()) {
    return WrongMemory("PushGradients", "grads", memory, memory_kind());
  }
  if (!bound_.load(std::memory_order_acquire)) {
    return absl::FailedPreconditionError("PushGradients before RegisterModel");
  }
  if (micro_batch >= job_.micro_batches) {
    return absl::InvalidArgumentError(absl::StrCat("micro_batch: must be < micro_batches (",
                                                   job_.micro_batches, "), got ", micro_batch));
  }
  if (range.empty() || range.end > plan_.total_elements()) {
    return absl::InvalidArgumentError(absl::StrCat("range: [", range.begin, ", ", range.end,
                                                   ") is empty or outside the ", "flat space [0, ",
                                                   plan_.total_elements(), ")"));
  }
  if (grads == nullptr) return absl::InvalidArgumentError("grads: null");
  if (dtype != DType::kFp32 && dtype != DType::kBf16 && dtype != DType::kFp16) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype: must be fp32, bf16 or fp16, got ", DTypeName(dtype)));
  }
  return CheckBuffer(grads, range.size() * DTypeSize(dtype), "PushGradients: grads");
}

void TrainerCollective::ResetContributions() {
  step_ = 0;
  micro_batch_ = 0;
  claimed_.clear();
  real_written_ = 0;
}

absl::Status TrainerCollective::BeginReduce(uint64_t step, uint32_t micro_batch,
                                            const FlatRange& range, bool* ignored) {
  *ignored = false;
  RETURN_IF_ERROR(Broken());
  if (finishing_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "PushGradients for step ", step, " while Step for step ", finishing_step_,
        " is running (it waits for the PushGradients calls already running, then exchanges and "
        "pushes; push again once it returns)"));
  }
  if (exchanged_step_ != 0) {
    if (step == exchanged_step_) {
      // A retry of a step whose rank sum is held: only its push is redone.
      *ignored = true;
      return absl::OkStatus();
    }
    exchanged_step_ = 0;  // that retry was abandoned
  }
  if (step_ != step) {
    if (step_ != 0) {
      return absl::FailedPreconditionError(absl::StrCat("PushGradients for step ", step,
                                                        " while pushes of step ", step_,
                                                        " are pending; call Step first"));
    }
    ResetContributions();
    step_ = step;
  }
  if (micro_batch < micro_batch_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PushGradients: micro-batch ", micro_batch, " of step ", step, " is complete; range [",
        range.begin, ", ", range.end, ") was already pushed"));
  }
  if (micro_batch > micro_batch_) {
    if (micro_batch != micro_batch_ + 1 || real_written_ != real_elements_ || writers_ != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("PushGradients: micro-batch ", micro_batch, " of step ", step,
                       " before micro-batch ", micro_batch_, " is complete (", real_written_,
                       " of ", real_elements_, " tensor elements pushed); the ", what_,
                       " sums micro-batches in order, push them one after the other"));
    }
    micro_batch_ = micro_batch;
    claimed_.clear();
    real_written_ = 0;
  }
  // Overlap with a claimed range of this micro-batch?
  auto it = claimed_.upper_bound(range.begin);
  if (it != claimed_.begin() && std::prev(it)->second > range.begin) it = std::prev(it);
  if (it != claimed_.end() && it->first < range.end) {
    const FlatRange clash = FlatRange{it->first, it->second}.Intersect(range);
    return absl::InvalidArgumentError(absl::StrCat("PushGradients: range [", clash.begin, ", ",
                                                   clash.end, ") of micro-batch ", micro_batch,
                                                   " was already pushed for step ", step));
  }
  // Claim it, merged with touching neighbours.
  uint64_t begin = range.begin, end = range.end;
  auto next = claimed_.lower_bound(range.end);
  if (next != claimed_.end() && next->first == end) {
    end = next->second;
    claimed_.erase(next);
  }
  auto prev = claimed_.lower_bound(begin);
  if (prev != claimed_.begin() && std::prev(prev)->second == begin) {
    prev = std::prev(prev);
    prev->second = end;
  } else {
    claimed_[begin] = end;
  }
  ++writers_;
  return absl::OkStatus();
}

absl::Status TrainerCollective::Incomplete(uint64_t step) const {
  const std::string who = absl::StrCat("Step ", step, ": rank ", job_.rank);
  if (step_ != step) {
    return absl::FailedPreconditionError(absl::StrCat(who, " pushed no gradient for this step"));
  }
  if (real_written_ == real_elements_ && micro_batch_ + 1 == job_.micro_batches) {
    return absl::OkStatus();
  }
  if (real_written_ == real_elements_) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, " pushed micro-batches 0..", micro_batch_, " of ", job_.micro_batches));
  }
  // The first real element not claimed.
  uint64_t missing = plan_.total_elements();
  const std::map<uint64_t, uint64_t>* claimed = &claimed_;
  plan_.ForEachRealSegment({0, plan_.total_elements()}, [&](const FlatRange& s) {
    if (missing != plan_.total_elements()) return;
    uint64_t pos = s.begin;
    auto it = claimed->upper_bound(pos);
    if (it != claimed->begin() && std::prev(it)->second > pos) pos = std::prev(it)->second;
    if (pos < s.end) missing = pos;
  });
  return absl::FailedPreconditionError(absl::StrCat(
      who, " pushed ", real_written_, " of ", real_elements_, " tensor elements of micro-batch ",
      micro_batch_, "; nothing was pushed for element ", missing));
}

absl::Status TrainerCollective::PushPartition(uint64_t step, absl::Time deadline,
                                              const std::vector<uint32_t>& no_grad,
                                              std::vector<uint8_t>* confirmed, bool* read_failed) {
  *read_failed = false;
  const DType wire = plan_.wire_dtype();
  for (size_t j = 0; j < my_buckets_.size(); ++j) {
    if ((*confirmed)[j]) continue;
    const Bucket& b = plan_.buckets()[my_buckets_[j]];
    absl::StatusOr<const void*> data = WireBucket(b.range, deadline);
    if (!data.ok()) {
      *read_failed = true;
      return absl::Status(
          data.status().code(),
          absl::StrCat("Step ", step, ": rank ", job_.rank, " reading its reduced ", "partition [",
                       b.range.begin, ", ", b.range.end, "): ", data.status().message()));
    }
    GradientPush push;
    push.job_id = job_.job_id;
    push.step = step;
    push.rank = job_.rank;
    push.incarnation = job_.incarnation;
    push.micro_batch = 0;  // the micro-batches are summed here
    push.micro_batches = 1;
    push.range = b.range;
    push.dtype = wire;
    push.data = *data;
    if (!no_grad.empty()) {
      const auto [first, last] = job_.layout->TensorsIn(b.range);
      for (auto it = std::lower_bound(no_grad.begin(), no_grad.end(), first);
           it != no_grad.end() && *it < last; ++it) {
        push.no_grad_tensors.push_back(*it);
      }
    }
    DataPath* daemon = job_.daemons[b.daemon];
    absl::StatusOr<uint64_t> sent =
        daemon->PushGradient(push, std::min(deadline, absl::Now() + job_.rpc_timeout));
    if (!sent.ok()) {
      return absl::Status(
          sent.status().code(),
          absl::StrCat("Step ", step, ": rank ", job_.rank, " pushing its reduced ", "partition [",
                       b.range.begin, ", ", b.range.end, ") to daemon ", daemon->address(), ": ",
                       sent.status().message()));
    }
    job_.traffic->AddPush(*sent);
    (*confirmed)[j] = 1;
  }
  return absl::OkStatus();
}

absl::Status TrainerCollective::MarkNoGradient(uint64_t step, uint32_t micro_batch,
                                               absl::Span<const uint32_t> tensors) {
  if (tensors.empty()) return absl::OkStatus();
  if (!carries_marks()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what_, " does not carry no-gradient marks (carries_no_grad_marks() is false): push ",
        "zeros without marking them, or use the Gloo collective or reduction mode DAEMON"));
  }
  RETURN_IF_ERROR(
      CheckMarks(job_, bound_.load(std::memory_order_acquire), micro_batch, tensors));
  const uint64_t count = job_.layout->tensors().size();
  absl::MutexLock lock(&mu_);
  if (marks_step_ != step) {
    marks_.clear();
    marks_step_ = step;
  }
  for (uint32_t t : tensors) marks_.insert(micro_batch * count + t);
  return absl::OkStatus();
}

void TrainerCollective::ClearMarks(uint64_t step) {
  if (marks_step_ != step) return;
  marks_.clear();
  marks_step_ = 0;
}

std::vector<uint8_t> TrainerCollective::LocalMarks(uint64_t step) const {
  const uint64_t count = job_.layout->tensors().size();
  std::vector<uint8_t> marks(count, 0);
  if (marks_step_ != step || marks_.empty()) return marks;
  for (uint64_t t = 0; t < count; ++t) {
    bool every = true;
    for (uint64_t mb = 0; mb < job_.micro_batches && every; ++mb) {
      every = marks_.count(mb * count + t) != 0;
    }
    marks[t] = every ? 1 : 0;
  }
  return marks;
}

absl::Status TrainerCollective::ExchangeMarks(std::vector<uint8_t>*, absl::Time) {
  // Finish calls it only when carries_marks().
  return absl::InternalError(absl::StrCat(what_, ": ExchangeMarks without carries_marks()"));
}

absl::Status TrainerCollective::Finish(uint64_t step, absl::Time deadline) {
  if (!bound_.load(std::memory_order_acquire)) {
    return absl::FailedPreconditionError("Step before RegisterModel");
  }
  bool exchange = true;
  std::vector<uint8_t> confirmed;
  std::vector<uint8_t> marks;  // this rank's, then every rank's (carries_marks())
  std::vector<uint32_t> no_grad;  // the tensors no rank had a gradient for
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(Broken());
    if (finishing_) {
      return absl::FailedPreconditionError(absl::StrCat("Step for step ", step,
                                                        " while Step for step ", finishing_step_,
                                                        " is running (one Step at a time)"));
    }
    if (gathering_) {
      return absl::FailedPreconditionError(
          absl::StrCat("Step for step ", step, " while GatherAll is running"));
    }
    // Claimed before the wait below releases mu_: from here on, new
    // PushGradients calls and a second Step are refused.
    finishing_ = true;
    finishing_step_ = step;
    auto no_writers = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return writers_ == 0; };
    if (!mu_.AwaitWithDeadline(absl::Condition(&no_writers), deadline)) {
      finishing_ = false;
      return absl::DeadlineExceededError(
          absl::StrCat("Step ", step, ": PushGradients calls still running at the deadline"));
    }
    if (exchanged_step_ == step) {
      exchange = false;  // a retry: the rank sum is held, only pushes are left
      no_grad = no_grad_;
    } else {
      exchanged_step_ = 0;
      if (absl::Status s = Incomplete(step); !s.ok()) {
        finishing_ = false;
        ResetContributions();
        ClearMarks(step);  // the step's pushes are dropped with their marks
        return s;
      }
      confirmed_.assign(my_buckets_.size(), 0);
      if (carries_marks()) marks = LocalMarks(step);
    }
    confirmed = confirmed_;
  }
  absl::Status status;
  if (exchange && carries_marks()) {
    status = ExchangeMarks(&marks, deadline);
    if (status.ok()) {
      for (size_t t = 0; t < marks.size(); ++t) {
        if (marks[t] != 0) no_grad.push_back(static_cast<uint32_t>(t));
      }
      absl::MutexLock lock(&mu_);
      no_grad_ = no_grad;
    }
  }
  if (exchange && status.ok()) status = Exchange(deadline);
  const bool exchanged = status.ok();
  bool read_failed = false;
  if (exchanged) status = PushPartition(step, deadline, no_grad, &confirmed, &read_failed);
  absl::MutexLock lock(&mu_);
  finishing_ = false;
  ResetContributions();
  ClearMarks(step);  // used (a retry of the pushes keeps no_grad_)
  if (!exchanged || read_failed) {
    broken_ = status;
    exchanged_step_ = 0;
  } else if (!status.ok()) {
    exchanged_step_ = step;
    confirmed_ = std::move(confirmed);
  } else {
    exchanged_step_ = 0;
  }
  return status;
}

absl::StatusOr<PushTicket> TrainerCollective::Reduce(uint64_t step, uint32_t micro_batch,
                                                     const FlatRange& range, const void* grads,
                                                     DType dtype, BufferUse, MemoryKind memory,
                                                     absl::Time deadline) {
  RETURN_IF_ERROR(CheckArguments(micro_batch, range, grads, dtype, memory));
  {
    absl::MutexLock lock(&mu_);
    bool ignored = false;
    RETURN_IF_ERROR(BeginReduce(step, micro_batch, range, &ignored));
    if (ignored) return PushTicket();
  }
  // The claimed range is this thread's alone; the copy runs without the lock.
  const absl::Status s = Accumulate(micro_batch, range, grads, dtype, deadline);
  const uint64_t real = plan_.RealElements(range);
  absl::MutexLock lock(&mu_);
  --writers_;
  if (!s.ok()) {
    if (broken_.ok()) broken_ = s;
    return s;
  }
  real_written_ += real;
  return PushTicket();
}

absl::Status TrainerCollective::CheckBuffer(const void*, uint64_t, const char*) const {
  return absl::OkStatus();
}

absl::Status TrainerCollective::FetchOwn(const FlatRange& own, void* own_dst, DType,
                                         const FetchRange& fetch_own, absl::Time) {
  return fetch_own(own, own_dst);
}

absl::Status TrainerCollective::AllGather(const FlatRange& range, void* dst, DType dtype,
                                          MemoryKind memory, const FetchRange& fetch_own,
                                          absl::Time deadline) {
  if (memory != memory_kind()) return WrongMemory("gather", "dst", memory, memory_kind());
  if (!bound_.load(std::memory_order_acquire)) {
    return absl::FailedPreconditionError("GatherAll before RegisterModel");
  }
  if (range.end <= plan_.total_elements() && !range.empty()) {
    RETURN_IF_ERROR(CheckBuffer(dst, range.size() * DTypeSize(dtype), "gather: dst"));
  }
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(Broken());
    if (finishing_ || gathering_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "GatherAll while ", finishing_ ? "Step" : "another GatherAll", " is running"));
    }
    gathering_ = true;
  }
  const size_t esize = DTypeSize(dtype);
  const FlatRange own = job_.map->UnpaddedPartition(job_.rank).Intersect(range);
  absl::Status status;
  if (range.end > plan_.total_elements() || range.empty()) {
    status = absl::InvalidArgumentError(
        absl::StrCat("range: [", range.begin, ", ", range.end, ") is empty or past the ",
                     plan_.total_elements(), " elements of the layout"));
  } else if (!own.empty()) {
    // The daemons' part first. A rank that fails here does not take part in
    // this all-gather, so its peers fail it too (at their deadline); it is
    // broken as they are, rather than out of step with them.
    status = FetchOwn(own, static_cast<uint8_t*>(dst) + (own.begin - range.begin) * esize, dtype,
                      fetch_own, deadline);
  }
  bool broke = job_.world_size > 1 && !status.ok() && !absl::IsInvalidArgument(status);
  if (status.ok()) {
    status = ExchangeGather(range, dst, dtype, deadline);
    broke = !status.ok();
  }
  absl::MutexLock lock(&mu_);
  gathering_ = false;
  if (broke && broken_.ok()) broken_ = status;
  return status;
}

}  // namespace zeroshard
