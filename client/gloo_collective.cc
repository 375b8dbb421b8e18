#include "client/gloo_collective.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <new>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
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

// Exchange rounds per step at most (see Allocate): far inside int, and the slot
// counter (uint64_t) cannot wrap in any run.
constexpr uint64_t kMaxRounds = uint64_t{1} << 24;
// Slots of the exchange start here, far from the slots of the barrier that
// Connect runs (Gloo's own collectives put a prefix in the top byte).
constexpr uint64_t kFirstSlot = uint64_t{1} << 32;

std::chrono::milliseconds Remaining(absl::Time deadline) {
  const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
  return std::chrono::milliseconds(std::max<int64_t>(ms, 1));
}

std::string Joined(const std::string& what, const std::exception& e) {
  return what.empty() ? std::string(e.what()) : absl::StrCat(what, ": ", e.what());
}

// After a failed wait for peer `waiting_for`: the peers whose receive
// (`receive(q)`, null where none was posted) had not completed, in rank
// order. Those after `waiting_for` were not awaited yet and are polled once
// (a wait that ended has closed the context's connections, but a completed
// receive still reports); `came(q)` is called for each that had come.
std::vector<uint32_t> MissingPeers(
    uint32_t n, uint32_t waiting_for, const std::vector<uint8_t>& received,
    const std::function<::gloo::transport::UnboundBuffer*(uint32_t)>& receive,
    const std::function<void(uint32_t)>& came) {
  std::vector<uint32_t> missing;
  for (uint32_t q = 0; q < n; ++q) {
    ::gloo::transport::UnboundBuffer* buffer = receive(q);
    if (buffer == nullptr || received[q]) continue;
    bool arrived = false;
    if (q > waiting_for) {
      try {
        arrived = buffer->waitRecv(std::chrono::milliseconds(1));
      } catch (const std::exception&) {
        arrived = false;
      }
    }
    if (arrived) {
      came(q);
    } else {
      missing.push_back(q);
    }
  }
  return missing;
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

// A FileStore whose every wait ends at `deadline`, or at the caller's
// timeout if that is sooner. FileStore::get waits for its key with
// Store::kDefaultTimeout (30 s) whatever the context's timeout, and
// FileStore::wait compares whole elapsed seconds with the timeout; both go
// through the virtual wait below. Polls as FileStore does (10 ms; no inotify,
// which NFS lacks).
class DeadlineFileStore final : public ::gloo::rendezvous::FileStore {
 public:
  // Throws what FileStore's constructor throws (the path does not resolve).
  DeadlineFileStore(const std::string& path, absl::Time deadline)
      : FileStore(path), deadline_(deadline) {}

  void wait(const std::vector<std::string>& keys) override { wait(keys, kDefaultTimeout); }

  // Throws gloo::IoException once the wait ends with a key missing.
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    absl::Time end = deadline_;
    if (timeout != ::gloo::kNoTimeout) end = std::min(end, absl::Now() + absl::FromChrono(timeout));
    while (!check(keys)) {
      const absl::Time now = absl::Now();
      if (now >= end) {
        throw ::gloo::IoException(
            absl::StrCat("key(s) ", absl::StrJoin(keys, ", "), " not in the rendezvous store by ",
                         now >= deadline_ ? "the deadline" : "the end of Gloo's timeout",
                         " (each key names the rank that writes it)"));
      }
      absl::SleepFor(std::min(absl::Milliseconds(10), end - now));
    }
  }

  // Whether the store holds `key` (the full key, prefix included); false
  // where it cannot tell.
  bool Has(const std::string& key) {
    try {
      return check({key});
    } catch (const std::exception&) {
      return false;
    }
  }

 private:
  const absl::Time deadline_;
};

}  // namespace

GlooCollective::GlooCollective(const Options& options)
    : TrainerCollective(kWhat), options_(options) {}

absl::StatusOr<std::unique_ptr<GlooCollective>> GlooCollective::Create(const Options& options) {
  if (options.rendezvous_dir.empty()) {
    return absl::InvalidArgumentError(
        "rendezvous_dir: required (a directory every rank of the job shares)");
  }
  if (options.hostname.empty() && options.interface.empty()) {
    return absl::InvalidArgumentError("hostname: required when interface is empty");
  }
  if (options.chunk_bytes < kMinExchangeChunkBytes ||
      options.chunk_bytes > kMaxExchangeChunkBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes: must be in ", kMinExchangeChunkBytes, "..",
                     kMaxExchangeChunkBytes, " (64 KiB..1 GiB), got ", options.chunk_bytes));
  }
  return std::unique_ptr<GlooCollective>(new GlooCollective(options));
}

GlooCollective::~GlooCollective() {
  // The buffers hold the context; drop them first, then the connections.
  send_buffer_.reset();
  recv_buffers_.clear();
  context_.reset();
}

uint64_t GlooCollective::allocated_bytes() const {
  const CollectiveJob& j = job();
  return plan().total_elements() * sizeof(float) +
         uint64_t{j.world_size - 1} * chunk_elements_ * sizeof(float) + staging_size_ +
         marks_size_;
}

absl::Status GlooCollective::Allocate(const CollectiveJob& job, const BucketPlan& plan) {
  const uint64_t chunk_elements = std::max<uint64_t>(
      1, std::min<uint64_t>(options_.chunk_bytes / sizeof(float), job.map->partition_elements()));
  // Partition 0 is the largest: its rounds are every rank's.
  const uint64_t rounds =
      (job.map->UnpaddedPartition(0).size() + chunk_elements - 1) / chunk_elements;
  if (job.world_size > 1 && rounds > kMaxRounds) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk_bytes: ", options_.chunk_bytes, " gives ", rounds,
        " exchange rounds per step for partitions of ", job.map->UnpaddedPartition(0).size(),
        " elements, more than ", kMaxRounds, "; use larger chunks"));
  }
  // Allocation failures are statuses, not std::bad_alloc.
  const uint64_t acc_elements = plan.total_elements();
  const uint64_t recv_elements = uint64_t{job.world_size - 1} * chunk_elements;
  const uint64_t staging = BucketPlan::StagingBytes(job.bucket_bytes, job.wire_dtype);
  auto exhausted = [&](uint64_t bytes, const char* what) {
    return absl::ResourceExhaustedError(absl::StrCat(kWhat, ": cannot allocate ", bytes,
                                                     " bytes for ", what, " (rank ", job.rank,
                                                     " of ", job.world_size, ")"));
  };
  std::unique_ptr<float[]> acc(new (std::nothrow) float[acc_elements]());
  if (acc == nullptr) {
    return exhausted(acc_elements * sizeof(float), "the fp32 gradient of the whole model");
  }
  std::unique_ptr<float[]> recv(new (std::nothrow) float[recv_elements]);
  if (recv == nullptr && recv_elements > 0) {
    return exhausted(recv_elements * sizeof(float), "the exchange's receive chunks");
  }
  std::unique_ptr<uint8_t[]> staging_buffer(new (std::nothrow) uint8_t[staging]);
  if (staging_buffer == nullptr) return exhausted(staging, "the push bucket");
  // Every rank's no-gradient marks, a byte per tensor (ExchangeMarks).
  const uint64_t marks = uint64_t{job.world_size} * job.layout->tensors().size();
  std::unique_ptr<uint8_t[]> marks_buffer(new (std::nothrow) uint8_t[std::max<uint64_t>(marks, 1)]);
  if (marks_buffer == nullptr) return exhausted(marks, "the ranks' no-gradient marks");
  chunk_elements_ = chunk_elements;
  marks_ = std::move(marks_buffer);
  marks_size_ = marks;
  acc_ = std::move(acc);
  recv_ = std::move(recv);
  staging_ = std::move(staging_buffer);
  staging_size_ = staging;
  return absl::OkStatus();
}

absl::Status GlooCollective::Accumulate(uint32_t micro_batch, const FlatRange& range,
                                        const void* grads, DType dtype, absl::Time) {
  const auto* src = static_cast<const uint8_t*>(grads);
  const size_t esize = DTypeSize(dtype);
  constexpr size_t kBlock = 2048;
  float tmp[kBlock];
  plan().ForEachRealSegment(range, [&](const FlatRange& s) {
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
  });
  return absl::OkStatus();
}

absl::Status GlooCollective::Connect(absl::Time deadline) {
  const std::string prefix = absl::StrCat("zeroshard/", job().job_id);
  const std::string where =
      absl::StrCat(kWhat, ": rank ", job().rank, " of ", job().world_size, ", rendezvous in ",
                   options_.rendezvous_dir, " (prefix ", prefix, ")");
  // Every wait in the store, including those inside connectFullMesh, ends
  // at the deadline.
  std::unique_ptr<DeadlineFileStore> store;
  {
    absl::Status s = CatchGloo(deadline, where, [&] {
      store = std::make_unique<DeadlineFileStore>(options_.rendezvous_dir, deadline);
    });
    if (!s.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(s.message(), " (the directory must exist and be shared by every rank)"));
    }
  }
  ::gloo::rendezvous::PrefixStore prefixed(prefix, *store);
  // PrefixStore's keys in the store are "<prefix>/<key>".
  auto arrived = [&](uint32_t r) { return absl::StrCat("arrived/", r); };
  auto full_key = [&](const std::string& key) { return absl::StrCat(prefix, "/", key); };
  {
    absl::Status s = CatchGloo(deadline, where,
                               [&] { prefixed.set(arrived(job().rank), std::vector<char>{'1'}); });
    if (!s.ok()) {
      // FileStore::set refuses a key whose file exists; any other failure
      // is the directory's.
      if (store->Has(full_key(arrived(job().rank)))) {
        return absl::FailedPreconditionError(
            absl::StrCat(s.message(), " (left by an earlier run of job ", job().job_id,
                         " whose rendezvous failed? remove its files, or use a fresh directory)"));
      }
      return absl::FailedPreconditionError(
          absl::StrCat(s.message(),
                       " (cannot write into the rendezvous directory: it must be a writable "
                       "directory that every rank shares)"));
    }
  }
  // Wait for every rank here, so that a missing rank is named.
  std::vector<std::string> keys;
  for (uint32_t r = 0; r < job().world_size; ++r) keys.push_back(arrived(r));
  {
    absl::Status s = CatchGloo(deadline, where, [&] { prefixed.wait(keys, Remaining(deadline)); });
    if (absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) {
      std::vector<uint32_t> missing, present;
      for (uint32_t r = 0; r < job().world_size; ++r) {
        (store->Has(full_key(arrived(r))) ? present : missing).push_back(r);
      }
      const std::string who = missing.empty()
                                  ? std::string("not every rank arrived before the deadline")
                                  : absl::StrCat("rank(s) ", absl::StrJoin(missing, ", "),
                                                 " did not arrive before the deadline (arrived: ",
                                                 absl::StrJoin(present, ", "), ")");
      return absl::DeadlineExceededError(absl::StrCat(
          where, ": ", who,
          "; a rank that did not arrive is not running, has not reached its first Step yet, or "
          "uses another rendezvous directory (every rank needs the same one: one host, or a "
          "shared filesystem)"));
    }
    RETURN_IF_ERROR(s);
  }
  ::gloo::transport::tcp::attr attr;
  if (!options_.interface.empty()) {
    attr.iface = options_.interface;
  } else {
    attr.hostname = options_.hostname;
  }
  auto context = std::make_shared<::gloo::rendezvous::Context>(static_cast<int>(job().rank),
                                                               static_cast<int>(job().world_size));
  absl::Status s = CatchGloo(deadline, where, [&] {
    context->setTimeout(Remaining(deadline));
    auto device = ::gloo::transport::tcp::CreateDevice(attr);
    context->connectFullMesh(prefixed, device);
    // Every rank past connectFullMesh has read every key (below).
    ::gloo::BarrierOptions barrier(context);
    barrier.setTimeout(Remaining(deadline));
    ::gloo::barrier(barrier);
    send_buffer_ = context->createUnboundBuffer(acc_.get(), plan().total_elements() * 4);
    // One per peer, so that a wait names the peer it waits for.
    for (uint32_t i = 0; i + 1 < job().world_size; ++i) {
      recv_buffers_.push_back(
          context->createUnboundBuffer(recv_.get() + i * chunk_elements_, chunk_elements_ * 4));
    }
  });
  if (!s.ok()) {
    send_buffer_.reset();
    recv_buffers_.clear();
    return s;
  }
  // Past the barrier every rank has read this rank's keys (its arrival, its
  // address), so they can go, leaving the directory clean for the job's
  // next run.
  for (const std::string& path : store->getAllKeyFilePaths()) std::remove(path.c_str());
  context_ = std::move(context);
  next_slot_ = kFirstSlot;
  return absl::OkStatus();
}

absl::Status GlooCollective::Exchange(absl::Time deadline) {
  const uint32_t n = job().world_size;
  if (n == 1) return absl::OkStatus();
  if (context_ == nullptr) RETURN_IF_ERROR(Connect(deadline));
  const uint32_t p = job().rank;
  const PartitionMap& map = *job().map;
  const uint64_t pe = map.partition_elements();
  const uint64_t c = chunk_elements_;
  std::vector<uint64_t> size(n);  // real (unpadded) elements of each partition
  for (uint32_t q = 0; q < n; ++q) size[q] = map.UnpaddedPartition(q).size();
  const uint64_t rounds = (size[0] + c - 1) / c;  // partition 0 is the largest
  auto index = [p](uint32_t q) -> uint64_t { return q < p ? q : q - 1; };  // slot in recv_
  // Every rank runs the same exchanges with the same rounds, so the slots
  // agree; a failed exchange ends the collective.
  const uint64_t slot_base = next_slot_;
  next_slot_ += std::max<uint64_t>(rounds, 1);
  uint64_t sent_bytes = 0, received_bytes = 0;
  std::vector<uint8_t> received(n);  // in the round, by peer
  for (uint64_t k = 0; k < rounds; ++k) {
    const uint64_t off = k * c;
    const uint64_t slot = slot_base + k;
    const uint64_t mine = off < size[p] ? std::min(c, size[p] - off) : 0;
    std::fill(received.begin(), received.end(), 0);
    int sends = 0;
    uint32_t waiting_for = n;  // the peer whose slice is awaited (n: none)
    absl::Status s = CatchGloo(deadline, "", [&] {
      for (uint32_t q = 0; q < n; ++q) {
        if (q == p) continue;
        if (mine > 0) recv_buffers_[index(q)]->recv(static_cast<int>(q), slot, 0, mine * 4);
        if (off < size[q]) {
          const uint64_t len = std::min(c, size[q] - off);
          send_buffer_->send(static_cast<int>(q), slot, (q * pe + off) * 4, len * 4);
          sent_bytes += len * 4;
          ++sends;
        }
      }
      for (uint32_t q = 0; q < n && mine > 0; ++q) {
        if (q == p) continue;
        waiting_for = q;
        if (!recv_buffers_[index(q)]->waitRecv(Remaining(deadline))) {
          GLOO_THROW_IO_EXCEPTION("receive aborted");
        }
        received[q] = 1;
        received_bytes += mine * 4;
      }
      waiting_for = n;
      for (; sends > 0; --sends) {
        if (!send_buffer_->waitSend(Remaining(deadline))) {
          GLOO_THROW_IO_EXCEPTION("send aborted");
        }
      }
    });
    if (!s.ok()) {
      std::string message = absl::StrCat(
          kWhat, ": rank ", p, ", round ", k + 1, " of ", rounds, " of the reduce-scatter, ",
          waiting_for < n ? absl::StrCat("receiving from rank ", waiting_for)
                          : std::string("sending"),
          ": ", s.message());
      if (waiting_for < n) {
        const std::vector<uint32_t> missing = MissingPeers(
            n, waiting_for, received,
            [&](uint32_t q) { return q == p ? nullptr : recv_buffers_[index(q)].get(); },
            [&](uint32_t) { received_bytes += mine * 4; });
        absl::StrAppend(&message, "; nothing had come from rank(s) ", absl::StrJoin(missing, ", "),
                        " in this round by then (not running, not in this step, or its "
                        "connection failed)");
      }
      job().traffic->AddCollectiveSent(sent_bytes);
      job().traffic->AddCollectiveReceived(received_bytes);
      return absl::Status(s.code(), message);
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
  job().traffic->AddCollectiveSent(sent_bytes);
  job().traffic->AddCollectiveReceived(received_bytes);
  return absl::OkStatus();
}

absl::Status GlooCollective::ExchangeMarks(std::vector<uint8_t>* marks, absl::Time deadline) {
  const CollectiveJob& job = this->job();
  const uint32_t n = job.world_size;
  const size_t count = marks->size();
  if (n == 1 || count == 0) return absl::OkStatus();
  uint8_t* all = marks_.get();
  std::memcpy(all + uint64_t{job.rank} * count, marks->data(), count);
  RETURN_IF_ERROR(AllGatherPieces(
      [&](uint32_t q) { return Piece{all + uint64_t{q} * count, count}; }, "no-gradient marks",
      "this step", deadline));
  // A tensor is without a gradient when every rank says so.
  for (size_t t = 0; t < count; ++t) {
    uint8_t every = 1;
    for (uint32_t q = 0; q < n && every != 0; ++q) every = all[uint64_t{q} * count + t];
    (*marks)[t] = every != 0 ? 1 : 0;
  }
  return absl::OkStatus();
}

absl::StatusOr<const void*> GlooCollective::WireBucket(const FlatRange& bucket, absl::Time) {
  const float* values = acc_.get() + bucket.begin;
  const DType wire = plan().wire_dtype();
  if (wire == DType::kFp32) return values;
  FromFloat(wire, values, staging_.get(), bucket.size());
  return staging_.get();
}

absl::Status GlooCollective::ExchangeGather(const FlatRange& range, void* dst, DType dtype,
                                            absl::Time deadline) {
  const CollectiveJob& job = this->job();
  if (job.world_size == 1) return absl::OkStatus();
  const size_t esize = DTypeSize(dtype);
  auto* bytes = static_cast<uint8_t*>(dst);
  // Rank q's piece of the range, where it goes in `dst`.
  return AllGatherPieces(
      [&](uint32_t q) {
        const FlatRange r = job.map->UnpaddedPartition(q).Intersect(range);
        if (r.empty()) return Piece{};
        return Piece{bytes + (r.begin - range.begin) * esize, r.size() * esize};
      },
      absl::StrCat("parameter all-gather of [", range.begin, ", ", range.end, ")"), "this gather",
      deadline);
}

absl::Status GlooCollective::AllGatherPieces(const std::function<Piece(uint32_t)>& piece,
                                       const std::string& what, const std::string& call,
                                       absl::Time deadline) {
  const CollectiveJob& job = this->job();
  const uint32_t n = job.world_size;
  const uint32_t p = job.rank;
  if (context_ == nullptr) RETURN_IF_ERROR(Connect(deadline));
  const Piece own = piece(p);
  const uint64_t slot = next_slot_++;
  uint64_t sent_bytes = 0, received_bytes = 0;
  // One buffer per peer over its piece (so that a wait names the peer it
  // waits for), and one over this rank's piece to send.
  std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> from(n);
  std::unique_ptr<::gloo::transport::UnboundBuffer> mine;
  std::vector<uint8_t> received(n);
  uint32_t waiting_for = n;  // the peer whose piece is awaited (n: none)
  absl::Status status = CatchGloo(deadline, "", [&] {
    if (own.bytes > 0) mine = context_->createUnboundBuffer(own.data, own.bytes);
    int sends = 0;
    for (uint32_t q = 0; q < n; ++q) {
      if (q == p) continue;
      const Piece theirs = piece(q);
      if (theirs.bytes > 0) {
        from[q] = context_->createUnboundBuffer(theirs.data, theirs.bytes);
        from[q]->recv(static_cast<int>(q), slot);
      }
      if (mine != nullptr) {
        mine->send(static_cast<int>(q), slot);
        sent_bytes += own.bytes;
        ++sends;
      }
    }
    for (uint32_t q = 0; q < n; ++q) {
      if (from[q] == nullptr) continue;
      waiting_for = q;
      if (!from[q]->waitRecv(Remaining(deadline))) GLOO_THROW_IO_EXCEPTION("receive aborted");
      received[q] = 1;
      received_bytes += piece(q).bytes;
    }
    waiting_for = n;
    for (; sends > 0; --sends) {
      if (!mine->waitSend(Remaining(deadline))) GLOO_THROW_IO_EXCEPTION("send aborted");
    }
  });
  if (!status.ok()) {
    std::string message = absl::StrCat(
        kWhat, ": rank ", p, ", ", what, ", ",
        waiting_for < n ? absl::StrCat("receiving from rank ", waiting_for) : std::string("sending"),
        ": ", status.message());
    if (waiting_for < n) {
      const std::vector<uint32_t> missing = MissingPeers(
          n, waiting_for, received, [&](uint32_t q) { return from[q].get(); },
          [&](uint32_t q) { received_bytes += piece(q).bytes; });
      absl::StrAppend(&message, "; nothing had come from rank(s) ", absl::StrJoin(missing, ", "),
                      " by then (not running, not in ", call, ", or its connection failed)");
    }
    status = absl::Status(status.code(), message);
  }
  job.traffic->AddCollectiveSent(sent_bytes);
  job.traffic->AddCollectiveReceived(received_bytes);
  return status;
}

}  // namespace zeroshard
