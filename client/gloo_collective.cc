#include "client/gloo_collective.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "gloo/barrier.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/transport/tcp/attr.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"

namespace zeroshard {

// Why a direct exchange and not gloo::ReduceScatterHalvingDoubling (or an
// allreduce): the halving-doubling reduce-scatter sums in an order given by
// its binary blocks (not rank order: with 3 ranks the result differs from
// daemon reduce in the last bit) and allocates two more buffers of the whole
// gradient per instance; an allreduce moves twice the bytes and leaves the
// whole sum on every rank. Here each round sends every peer q its slice of
// partition q and receives this rank's slice of partition p from every peer
// over Gloo's unbound buffers, then sums the N_d slices in rank order. Each
// rank sends and receives (N_d - 1)/N_d of the real elements, as a ring or
// halving-doubling reduce-scatter does, the partitions may be uneven (the
// padding past total_elements is never sent), and memory stays at N_d - 1
// chunks.

namespace {

constexpr char kWhat[] = "trainer collective (Gloo)";

std::chrono::milliseconds Remaining(absl::Time deadline) {
  const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
  return std::chrono::milliseconds(std::max<int64_t>(ms, 1));
}

std::string Joined(const std::string& what, const std::exception& e) {
  return what.empty() ? std::string(e.what()) : absl::StrCat(what, ": ", e.what());
}

// Runs `fn`, converting whatever Gloo throws into a status: a timeout
// (IoException once the deadline has passed) is DeadlineExceeded, another
// I/O error Unavailable, anything else FailedPrecondition.
template <typename Fn>
absl::Status CatchGloo(absl::Time deadline, const std::string& what, Fn fn) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const ::gloo::IoException& e) {
    if (absl::Now() + absl::Milliseconds(50) >= deadline) {
      return absl::DeadlineExceededError(Joined(what, e));
    }
    return absl::UnavailableError(Joined(what, e));
  } catch (const ::gloo::Exception& e) {
    return absl::FailedPreconditionError(Joined(what, e));
  } catch (const ::gloo::EnforceNotMet& e) {
    return absl::FailedPreconditionError(Joined(what, e));
  } catch (const std::exception& e) {
    return absl::FailedPreconditionError(Joined(what, e));
  }
}

void AddInto(float* dst, const float* src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] += src[i];
}

}  // namespace

GlooCollective::GlooCollective(const Options& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<GlooCollective>> GlooCollective::Create(const Options& options) {
  if (options.rendezvous_dir.empty()) {
    return absl::InvalidArgumentError(
        "rendezvous_dir: required (a directory every rank of the job shares)");
  }
  if (options.hostname.empty() && options.interface.empty()) {
    return absl::InvalidArgumentError("hostname: required when interface is empty");
  }
  if (options.chunk_bytes < 4 || options.chunk_bytes > (1ull << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes: must be in 4..2^30, got ", options.chunk_bytes));
  }
  return std::unique_ptr<GlooCollective>(new GlooCollective(options));
}

GlooCollective::~GlooCollective() {
  // The buffers hold the context; drop them first, then the connections.
  send_buffer_.reset();
  recv_buffer_.reset();
  context_.reset();
}

uint64_t GlooCollective::staging_bytes() const {
  if (!bound_.load(std::memory_order_acquire)) return 0;
  return plan_.total_elements() * sizeof(float) +
         uint64_t{job_.world_size - 1} * chunk_elements_ * sizeof(float) +
         BucketPlan::StagingBytes(job_.bucket_bytes, job_.wire_dtype);
}

absl::Status GlooCollective::Bind(const CollectiveJob& job) {
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
  absl::StatusOr<BucketPlan> plan =
      BucketPlan::Create(*job.layout, *job.map, job.bucket_bytes, job.wire_dtype);
  if (!plan.ok()) return plan.status();
  job_ = job;
  plan_ = *std::move(plan);
  real_elements_ = plan_.RealElements({0, plan_.total_elements()});
  chunk_elements_ = std::max<uint64_t>(
      1, std::min<uint64_t>(options_.chunk_bytes / sizeof(float), job.map->partition_elements()));
  for (size_t i = 0; i < plan_.buckets().size(); ++i) {
    if (plan_.buckets()[i].partition == job.rank) my_buckets_.push_back(i);
  }
  acc_.reset(new float[plan_.total_elements()]());
  recv_.reset(new float[uint64_t{job.world_size - 1} * chunk_elements_]);
  staging_.reset(new uint8_t[BucketPlan::StagingBytes(job.bucket_bytes, job.wire_dtype)]);
  {
    absl::MutexLock lock(&mu_);
    confirmed_.assign(my_buckets_.size(), 0);
  }
  bound_.store(true, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status GlooCollective::CheckArguments(uint32_t micro_batch, const FlatRange& range,
                                            const void* grads, DType dtype) const {
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
  return absl::OkStatus();
}

void GlooCollective::ResetContributions() {
  step_ = 0;
  micro_batch_ = 0;
  claimed_.clear();
  real_written_ = 0;
}

absl::Status GlooCollective::BeginReduce(uint64_t step, uint32_t micro_batch,
                                         const FlatRange& range, bool* ignored) {
  *ignored = false;
  if (!broken_.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        kWhat, " failed earlier and cannot continue (restart the ranks): ", broken_.message()));
  }
  if (finishing_) {
    return absl::FailedPreconditionError(
        absl::StrCat("PushGradients for step ", step, " while Step is running"));
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
                       " of ", real_elements_, " tensor elements pushed); the ", kWhat,
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

absl::StatusOr<PushTicket> GlooCollective::Reduce(uint64_t step, uint32_t micro_batch,
                                                  const FlatRange& range, const void* grads,
                                                  DType dtype, BufferUse, absl::Time) {
  if (absl::Status s = CheckArguments(micro_batch, range, grads, dtype); !s.ok()) return s;
  {
    absl::MutexLock lock(&mu_);
    bool ignored = false;
    if (absl::Status s = BeginReduce(step, micro_batch, range, &ignored); !s.ok()) return s;
    if (ignored) return PushTicket();
  }
  // The claimed range is this thread's alone; the copy runs without the lock.
  const auto* src = static_cast<const uint8_t*>(grads);
  const size_t esize = DTypeSize(dtype);
  constexpr size_t kBlock = 2048;
  float tmp[kBlock];
  uint64_t real = 0;
  plan_.ForEachRealSegment(range, [&](const FlatRange& s) {
    float* dst = acc_.get() + s.begin;
    const uint8_t* from = src + (s.begin - range.begin) * esize;
    if (micro_batch == 0) {  // the first micro-batch overwrites the last step's values
      if (dtype == DType::kFp32) {
        std::memcpy(dst, from, s.size() * sizeof(float));
      } else {
        ToFloat(dtype, from, dst, s.size());
      }
    } else if (dtype == DType::kFp32) {
      AddInto(dst, reinterpret_cast<const float*>(from), s.size());
    } else {
      for (uint64_t i = 0; i < s.size(); i += kBlock) {
        const size_t n = std::min<uint64_t>(kBlock, s.size() - i);
        ToFloat(dtype, from + i * esize, tmp, n);
        AddInto(dst + i, tmp, n);
      }
    }
    real += s.size();
  });
  absl::MutexLock lock(&mu_);
  real_written_ += real;
  --writers_;
  return PushTicket();
}

absl::Status GlooCollective::Incomplete(uint64_t step) const {
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

absl::Status GlooCollective::Connect(absl::Time deadline) {
  const std::string prefix = absl::StrCat("zeroshard/", job_.job_id);
  const std::string where =
      absl::StrCat(kWhat, ": rank ", job_.rank, " of ", job_.world_size, ", rendezvous in ",
                   options_.rendezvous_dir, " (prefix ", prefix, ")");
  std::unique_ptr<::gloo::rendezvous::FileStore> store;
  {
    absl::Status s = CatchGloo(deadline, where, [&] {
      store = std::make_unique<::gloo::rendezvous::FileStore>(options_.rendezvous_dir);
    });
    if (!s.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(s.message(), " (the directory must exist and be shared by every rank)"));
    }
  }
  ::gloo::rendezvous::PrefixStore prefixed(prefix, *store);
  {
    absl::Status s = CatchGloo(deadline, where, [&] {
      prefixed.set(absl::StrCat("arrived/", job_.rank), std::vector<char>{'1'});
    });
    if (!s.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(s.message(), " (left by an earlier run of job ", job_.job_id,
                       " whose rendezvous failed? remove them, or use a fresh directory)"));
    }
  }
  // Wait for every rank here, with our deadline (the transport's own waits
  // in the store use Gloo's default of 30 s). FileStore compares whole
  // elapsed seconds with the timeout: ask for a second less.
  std::vector<std::string> keys;
  for (uint32_t r = 0; r < job_.world_size; ++r) keys.push_back(absl::StrCat("arrived/", r));
  {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now()) - 1000;
    absl::Status s = CatchGloo(deadline, where, [&] {
      prefixed.wait(keys, std::chrono::milliseconds(std::max<int64_t>(ms, 1)));
    });
    if (absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) {
      return absl::DeadlineExceededError(absl::StrCat(
          where,
          ": not every rank arrived before the deadline; a rank is missing, has not "
          "reached its first Step yet, or uses another rendezvous directory (every rank needs the "
          "same one: one host, or a shared filesystem)"));
    }
    RETURN_IF_ERROR(s);
  }
  ::gloo::transport::tcp::attr attr;
  if (!options_.interface.empty()) {
    attr.iface = options_.interface;
  } else {
    attr.hostname = options_.hostname;
  }
  auto context = std::make_shared<::gloo::rendezvous::Context>(static_cast<int>(job_.rank),
                                                               static_cast<int>(job_.world_size));
  absl::Status s = CatchGloo(deadline, where, [&] {
    context->setTimeout(Remaining(deadline));
    auto device = ::gloo::transport::tcp::CreateDevice(attr);
    context->connectFullMesh(prefixed, device);
    // Every rank past connectFullMesh has read every key (below).
    ::gloo::BarrierOptions barrier(context);
    barrier.setTimeout(Remaining(deadline));
    ::gloo::barrier(barrier);
    send_buffer_ = context->createUnboundBuffer(acc_.get(), plan_.total_elements() * 4);
    recv_buffer_ = context->createUnboundBuffer(
        recv_.get(), uint64_t{job_.world_size - 1} * chunk_elements_ * 4);
  });
  if (!s.ok()) {
    send_buffer_.reset();
    recv_buffer_.reset();
    return s;
  }
  // Past the barrier every rank has read this rank's keys (its arrival, its
  // address), so they can go, leaving the directory clean for the job's
  // next run.
  for (const std::string& path : store->getAllKeyFilePaths()) std::remove(path.c_str());
  context_ = std::move(context);
  return absl::OkStatus();
}

absl::Status GlooCollective::Exchange(absl::Time deadline) {
  const uint32_t n = job_.world_size;
  const uint32_t p = job_.rank;
  const PartitionMap& map = *job_.map;
  const uint64_t pe = map.partition_elements();
  const uint64_t c = chunk_elements_;
  std::vector<uint64_t> size(n);  // real (unpadded) elements of each partition
  for (uint32_t q = 0; q < n; ++q) size[q] = map.UnpaddedPartition(q).size();
  const uint64_t rounds = (size[0] + c - 1) / c;  // partition 0 is the largest
  auto index = [p](uint32_t q) -> uint64_t { return q < p ? q : q - 1; };  // slot in recv_
  int slot_base = 0;
  RETURN_IF_ERROR(CatchGloo(deadline, kWhat, [&] {
    slot_base = context_->nextSlot(static_cast<int>(std::max<uint64_t>(rounds, 1)));
  }));
  uint64_t sent_bytes = 0, received_bytes = 0;
  std::vector<bool> received(n);  // in the round, by peer
  for (uint64_t k = 0; k < rounds; ++k) {
    const uint64_t off = k * c;
    const uint64_t slot = static_cast<uint64_t>(slot_base) + k;
    const uint64_t mine = off < size[p] ? std::min(c, size[p] - off) : 0;
    std::fill(received.begin(), received.end(), false);
    int recvs = 0, sends = 0;
    absl::Status s = CatchGloo(deadline, "", [&] {
      for (uint32_t q = 0; q < n; ++q) {
        if (q == p) continue;
        if (mine > 0) {
          recv_buffer_->recv(static_cast<int>(q), slot, index(q) * c * 4, mine * 4);
          ++recvs;
        }
        if (off < size[q]) {
          const uint64_t len = std::min(c, size[q] - off);
          send_buffer_->send(static_cast<int>(q), slot, (q * pe + off) * 4, len * 4);
          sent_bytes += len * 4;
          ++sends;
        }
      }
      for (; recvs > 0; --recvs) {
        int from = -1;
        if (!recv_buffer_->waitRecv(&from, Remaining(deadline))) {
          GLOO_THROW_IO_EXCEPTION("receive aborted");
        }
        if (from >= 0 && from < static_cast<int>(n)) received[from] = true;
        received_bytes += mine * 4;
      }
      for (; sends > 0; --sends) {
        if (!send_buffer_->waitSend(Remaining(deadline))) {
          GLOO_THROW_IO_EXCEPTION("send aborted");
        }
      }
    });
    if (!s.ok()) {
      s = absl::Status(s.code(), absl::StrCat(kWhat, ": rank ", p, ", round ", k + 1, " of ",
                                              rounds, " of the reduce-scatter: ", s.message()));
      std::vector<uint32_t> missing;
      for (uint32_t q = 0; q < n; ++q) {
        if (q != p && mine > 0 && !received[q]) missing.push_back(q);
      }
      if (!missing.empty()) {
        s = absl::Status(s.code(), absl::StrCat(s.message(), "; nothing came from rank(s) ",
                                                absl::StrJoin(missing, ", "),
                                                " (not running, or not in this step)"));
      }
      job_.traffic->AddCollectiveSent(sent_bytes);
      job_.traffic->AddCollectiveReceived(received_bytes);
      return s;
    }
    if (mine == 0) continue;
    // Sum in rank order: (((g_0 + g_1) + g_2) + ...).
    float* own = acc_.get() + p * pe + off;
    auto from = [&](uint32_t r) -> const float* {
      return r == p ? own : recv_.get() + index(r) * c;
    };
    float* sum = p == 0 ? own : recv_.get() + index(0) * c;
    for (uint32_t r = 1; r < n; ++r) AddInto(sum, from(r), mine);
    if (sum != own) std::memcpy(own, sum, mine * sizeof(float));
  }
  job_.traffic->AddCollectiveSent(sent_bytes);
  job_.traffic->AddCollectiveReceived(received_bytes);
  return absl::OkStatus();
}

absl::Status GlooCollective::PushPartition(uint64_t step, absl::Time deadline,
                                           std::vector<uint8_t>* confirmed) {
  const DType wire = plan_.wire_dtype();
  for (size_t j = 0; j < my_buckets_.size(); ++j) {
    if ((*confirmed)[j]) continue;
    const Bucket& b = plan_.buckets()[my_buckets_[j]];
    const float* values = acc_.get() + b.range.begin;
    const void* data = values;
    if (wire != DType::kFp32) {
      FromFloat(wire, values, staging_.get(), b.range.size());
      data = staging_.get();
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
    push.data = data;
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

absl::Status GlooCollective::Finish(uint64_t step, absl::Time deadline) {
  if (!bound_.load(std::memory_order_acquire)) {
    return absl::FailedPreconditionError("Step before RegisterModel");
  }
  bool exchange = true;
  std::vector<uint8_t> confirmed;
  {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          kWhat, " failed earlier and cannot continue (restart the ranks): ", broken_.message()));
    }
    if (finishing_) return absl::FailedPreconditionError("Step while another Step runs");
    auto no_writers = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return writers_ == 0; };
    if (!mu_.AwaitWithDeadline(absl::Condition(&no_writers), deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat("Step ", step, ": PushGradients calls still running at the deadline"));
    }
    if (exchanged_step_ == step) {
      exchange = false;  // a retry: the rank sum is held, only pushes are left
    } else {
      exchanged_step_ = 0;
      if (absl::Status s = Incomplete(step); !s.ok()) {
        ResetContributions();
        return s;
      }
      confirmed_.assign(my_buckets_.size(), 0);
    }
    confirmed = confirmed_;
    finishing_ = true;
  }
  absl::Status status;
  if (exchange && job_.world_size > 1) {
    if (context_ == nullptr) status = Connect(deadline);
    if (status.ok()) status = Exchange(deadline);
  }
  const bool exchanged = status.ok();
  if (exchanged) status = PushPartition(step, deadline, &confirmed);
  absl::MutexLock lock(&mu_);
  finishing_ = false;
  ResetContributions();
  if (!exchanged) {
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

}  // namespace zeroshard
