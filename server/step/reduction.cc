#include "server/step/reduction.h"

#include <algorithm>
#include <iterator>
#include <set>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/fnv.h"

namespace zeroshard {
namespace {

std::string RangeString(const FlatRange& r) { return absl::StrCat("[", r.begin, ", ", r.end, ")"); }

template <typename T>
void HashValue(uint64_t& h, const T& v) {
  Fnv1aMix(h, &v, sizeof(v));
}

// The CRC-32C of a contribution's payload: the sender's, or computed here
// for one that came without (a staged push). Only for duplicates: a pass
// over every staged push would cost the push path a third of its bandwidth.
uint32_t PayloadCrc(const Contribution& c) {
  return c.crc32c != 0 ? c.crc32c : Crc32c(c.payload.data(), c.payload.size());
}

}  // namespace

ReductionState::ReductionState(Options options, float* grad, ShardOptimizer* optimizer,
                               MemoryLedger* ledger)
    : options_(std::move(options)), grad_(grad), optimizer_(optimizer), ledger_(ledger) {
  if (options_.tensors != nullptr) has_grad_.assign(options_.tensors->entries().size(), 0);
}

std::vector<uint32_t> ReductionState::NoGradTensors() const {
  std::vector<uint32_t> out;
  if (options_.tensors == nullptr) return out;
  const std::vector<OwnedTensors::Entry>& entries = options_.tensors->entries();
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!entries[i].frozen && has_grad_[i] == 0) out.push_back(entries[i].index);
  }
  return out;
}

ReductionState::~ReductionState() { Reset(); }

uint32_t ReductionState::Order(const Contribution& c, uint32_t micro_batches) const {
  return options_.mode == ReductionMode::kDaemon ? c.rank * micro_batches + c.micro_batch
                                                 : c.micro_batch;
}

uint32_t ReductionState::Expected(uint32_t micro_batches) const {
  const uint32_t mb = std::max<uint32_t>(micro_batches, 1);
  return options_.mode == ReductionMode::kDaemon ? options_.world_size * mb : mb;
}

absl::Status ReductionState::CheckOne(const std::map<uint64_t, Key>& keys, const Contribution& c,
                                      size_t index, uint32_t order,
                                      const std::map<uint64_t, uint64_t>& new_keys) const {
  const FlatRange& r = c.range;
  // The range must equal an existing key or overlap none.
  auto conflict = [&](const auto& m, auto end_of) -> std::string {
    auto it = m.upper_bound(r.begin);
    if (it != m.begin()) {
      auto prev = std::prev(it);
      const uint64_t prev_end = end_of(prev->second);
      if (prev->first == r.begin && prev_end == r.end) return "";
      if (prev_end > r.begin) return RangeString({prev->first, prev_end});
    }
    if (it != m.end() && it->first < r.end) return absl::StrCat("[", it->first, ", ...)");
    return "";
  };
  std::string clash = conflict(keys, [](const Key& k) { return k.end; });
  if (clash.empty()) clash = conflict(new_keys, [](uint64_t end) { return end; });
  if (!clash.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "chunk ", index, ".range ", RangeString(r), " overlaps the chunk ", clash,
        " pushed for this step: every rank must cut its gradients into the same chunks"));
  }
  auto key = keys.find(r.begin);
  if (key == keys.end()) return absl::OkStatus();
  const Key& k = key->second;
  uint32_t applied_crc = 0;
  if (order < k.next_order) {
    applied_crc = k.crcs[order];
  } else if (auto p = k.pending.find(order); p != k.pending.end()) {
    applied_crc = p->second.crc32c;
  } else {
    return absl::OkStatus();
  }
  const std::string what = absl::StrCat("chunk ", index, ": rank ", c.rank, " micro-batch ",
                                        c.micro_batch, " already pushed range ", RangeString(r),
                                        " for this step");
  if (applied_crc != 0 && PayloadCrc(c) == applied_crc) {
    return absl::AlreadyExistsError(
        absl::StrCat(what, " with the same CRC-32C (a duplicate is never counted twice)"));
  }
  if (applied_crc == 0 && replacing_.count(c.rank) > 0) {
    return absl::AlreadyExistsError(
        absl::StrCat(what,
                     " by the rank's previous process, whose push carried no CRC-32C (staged): its "
                     "bytes are kept and not compared, and this one is not counted"));
  }
  if (applied_crc == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        what,
        "; the held one carried no CRC-32C, so the bytes cannot be compared and nothing "
        "was applied (a rank pushes each range once per micro-batch and step)"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      what,
      " with other bytes (CRC-32C differs); nothing was applied: a rank pushes each range "
      "once per micro-batch and step, and a restarted rank must compute the open step's "
      "gradient as its predecessor did"));
}

bool ReductionState::WaitingUpTo(const Key& key, uint32_t order) {
  for (uint32_t o = key.next_order; o < order; ++o) {
    if (key.pending.count(o) == 0) return false;
  }
  return true;
}

bool ReductionState::Completes(const Key& key, uint32_t micro_batches) const {
  return key.pending.size() + 1 == Expected(micro_batches) - key.next_order;
}

uint64_t ReductionState::BookkeepingNow() const {
  return keys_.size() * kKeyBytes + applied_ * kAppliedBytes +
         pending_entries_ * kPendingEntryBytes + pending_marks_bytes_;
}

absl::Status ReductionState::Check(const std::vector<Contribution>& batch, uint32_t micro_batches,
                                   uint64_t* pending_bytes, uint64_t* bookkeeping_bytes,
                                   bool hold) const {
  return CheckAgainst(keys_, micro_batches_, batch, micro_batches, pending_bytes,
                      bookkeeping_bytes, hold);
}

absl::Status ReductionState::CheckFresh(const std::vector<Contribution>& batch,
                                        uint32_t micro_batches) const {
  static const std::map<uint64_t, Key> kNone;
  uint64_t pending = 0, bookkeeping = 0;
  return CheckAgainst(kNone, 0, batch, micro_batches, &pending, &bookkeeping, false);
}

absl::Status ReductionState::CheckAgainst(const std::map<uint64_t, Key>& keys,
                                          uint32_t micro_batches_now,
                                          const std::vector<Contribution>& batch,
                                          uint32_t micro_batches, uint64_t* pending_bytes,
                                          uint64_t* bookkeeping_bytes, bool hold) const {
  *pending_bytes = 0;
  *bookkeeping_bytes = 0;
  if (micro_batches_now != 0 && micro_batches != micro_batches_now) {
    return absl::FailedPreconditionError(absl::StrCat(
        "chunk 0.micro_batches: this step uses ", micro_batches_now, " micro-batches per rank, got ",
        micro_batches));
  }
  std::map<uint64_t, uint64_t> new_keys;  // begin -> end, keys this batch creates
  std::set<std::pair<uint64_t, uint32_t>> seen;
  for (size_t i = 0; i < batch.size(); ++i) {
    const Contribution& c = batch[i];
    const uint32_t order = Order(c, micro_batches);
    if (!seen.insert({c.range.begin, order}).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk ", i, ": rank ", c.rank, " micro-batch ", c.micro_batch, " range ",
          RangeString(c.range), " appears twice in one push"));
    }
    if (absl::Status s = CheckOne(keys, c, i, order, new_keys); !s.ok()) return s;
    auto key = keys.find(c.range.begin);
    if (key == keys.end()) new_keys.emplace(c.range.begin, c.range.end);
    const uint32_t next = key == keys.end() ? 0 : key->second.next_order;
    // Summed at once when every contribution before it (or every other one
    // of the range) is waiting; else buffered, or held. An upper bound:
    // earlier chunks of the batch may bring this one's turn.
    const bool waits = key == keys.end() ? order != next : !SumsNow(key->second, order);
    if (waits && !hold) *pending_bytes += c.payload.size();
    *bookkeeping_bytes += waits || hold
                              ? kPendingEntryBytes + MarksBytes(c.no_grad.size())
                              : kAppliedBytes;
  }
  *bookkeeping_bytes += new_keys.size() * kKeyBytes;
  return absl::OkStatus();
}

bool ReductionState::Admit(uint64_t pending_bytes) const {
  return pending_bytes == 0 || pending_bytes_ + pending_bytes <= options_.pending_budget_bytes;
}

uint64_t ReductionState::Apply(const std::vector<Contribution>& batch, uint32_t micro_batches,
                               uint64_t reserved_pending, uint64_t reserved_bookkeeping,
                               float grad_scale,
                               std::vector<std::shared_ptr<HeldContribution>>* hold) {
  micro_batches_ = micro_batches;
  pending_bytes_ += reserved_pending;          // booked; trimmed to what stays buffered below
  bookkeeping_bytes_ += reserved_bookkeeping;  // likewise
  uint64_t elements = 0;
  if (hold != nullptr) hold->assign(batch.size(), nullptr);
  for (size_t i = 0; i < batch.size(); ++i) {
    const Contribution& c = batch[i];
    const uint32_t order = Order(c, micro_batches);
    const size_t n = c.range.size();
    auto [it, inserted] = keys_.try_emplace(c.range.begin);
    Key& key = it->second;
    if (inserted) {
      key.end = c.range.end;
      key.partition = static_cast<uint32_t>(c.range.begin / options_.partition_elements);
    }
    elements += n;
    // A range whose sum is in flight takes its next ones as waiting.
    if (hold != nullptr && (key.summing || !Completes(key, micro_batches))) {
      Pending& p = AddPending(key, order, c);
      p.view = c.payload;
      p.held = std::make_shared<HeldContribution>();
      p.held->begin = c.range.begin;
      p.held->order = order;
      p.held->bytes = c.payload.size();
      (*hold)[i] = p.held;
      continue;
    }
    if (SumsNow(key, order)) {
      // Next in order, or every one before it waits: summed now with the
      // waiting ones around it, from where it is.
      SumRun(c.range.begin, key, &c, order, grad_scale);
      continue;
    }
    Pending& p = AddPending(key, order, c);
    p.bytes.assign(c.payload.begin(), c.payload.end());
    buffered_bytes_ += p.bytes.size();
  }
  // Give back what the caller's upper bounds over-reserved and what drained.
  ReleaseUnheld();
  return elements;
}

ReductionState::Pending& ReductionState::AddPending(Key& key, uint32_t order,
                                                    const Contribution& c) {
  Pending& p = key.pending[order];
  p.dtype = c.dtype;
  p.crc32c = c.crc32c;
  p.no_grad.assign(c.no_grad.begin(), c.no_grad.end());
  pending_marks_bytes_ += MarksBytes(p.no_grad.size());
  ++pending_entries_;
  return p;
}

std::map<uint32_t, ReductionState::Pending>::iterator ReductionState::ErasePending(
    Key& key, std::map<uint32_t, Pending>::iterator p, HeldContribution::State state) {
  if (p->second.held != nullptr) p->second.held->state = state;
  if (p->second.view.data() == nullptr) buffered_bytes_ -= p->second.bytes.size();
  pending_marks_bytes_ -= MarksBytes(p->second.no_grad.size());
  --pending_entries_;
  return key.pending.erase(p);
}

void ReductionState::SumRun(uint64_t begin, Key& key, const Contribution* c, uint32_t order,
                            float grad_scale) {
  // The contributions in order, summed in one pass (the same bits as one
  // pass each).
  SumJob job;
  job.begin = begin;
  job.dst = grad_ + (begin - options_.owned.begin);
  job.n = key.end - begin;
  // Contribution 0 overwrites: the buffer holds the previous step's sum.
  job.first = key.next_order == 0;
  job.grad_scale = grad_scale;
  job.optimizer = optimizer_;
  uint32_t next = key.next_order;
  for (;; ++next) {
    if (c != nullptr && next == order) {
      job.run.push_back({c->payload.data(), c->dtype});
      key.crcs.push_back(c->crc32c);
      MarkGrads({begin, key.end}, c->no_grad);
      ++applied_;  // booked as applied by Check (the others as waiting)
      continue;
    }
    auto p = key.pending.find(next);
    if (p == key.pending.end()) break;
    Pending& e = p->second;
    // Moving the copy keeps its bytes where they are.
    job.run.push_back({e.data(), e.dtype});
    key.crcs.push_back(e.crc32c);
    MarkGrads({begin, key.end}, e.no_grad);
    pending_marks_bytes_ -= MarksBytes(e.no_grad.size());
    ++job.entries;
    if (e.held != nullptr) {
      e.held->state = HeldContribution::State::kSumming;
      job.held.push_back(std::move(e.held));
    } else {
      job.copies.push_back(std::move(e.bytes));
    }
    key.pending.erase(p);
  }
  if (job.run.empty()) return;
  ++sum_passes_;
  summed_contributions_ += job.run.size();
  key.next_order = next;
  job.last = next == Expected(micro_batches_);
  ++sums_in_flight_;
  if (options_.defer_sums) {
    key.summing = true;
    ready_.push_back(std::move(job));
    return;
  }
  RunSum(job);
  Settle(key, job);
  --sums_in_flight_;
}

void ReductionState::MarkGrads(FlatRange range, absl::Span<const uint32_t> no_grad) {
  if (options_.tensors == nullptr) return;
  const auto [first, last] = options_.tensors->In(range);
  size_t skip = 0;
  for (size_t i = first; i < last; ++i) {
    const uint32_t index = options_.tensors->entries()[i].index;
    while (skip < no_grad.size() && no_grad[skip] < index) ++skip;
    if (skip == no_grad.size() || no_grad[skip] != index) has_grad_[i] = 1;
  }
}

void ReductionState::RunSum(SumJob& job) {
  ShardOptimizer* const opt = job.optimizer;
  if (job.last) {
    // The run ends with the range's last one: its pass takes the range's
    // norm too, block by block.
    job.stats = opt->SumContributions(job.dst, job.run, job.n, job.first, &job.grad_scale);
  } else if (job.run.size() > 1) {
    opt->SumContributions(job.dst, job.run, job.n, job.first, nullptr);
  } else if (job.first) {
    opt->ConvertIn(job.dst, job.run[0].data, job.run[0].type, job.n);
  } else {
    opt->Accumulate(job.dst, job.run[0].data, job.run[0].type, job.n);
  }
}

void ReductionState::Settle(Key& key, SumJob& job) {
  if (job.last) key.stats = job.stats;
  for (const std::shared_ptr<HeldContribution>& h : job.held) {
    h->state = HeldContribution::State::kDone;
  }
  for (const std::vector<uint8_t>& b : job.copies) buffered_bytes_ -= b.size();
  // Booked as waiting entries until now: counted as applied from here.
  pending_entries_ -= job.entries;
  applied_ += job.entries;
  job.held.clear();
  job.copies.clear();
  job.entries = 0;
}

std::vector<ReductionState::SumJob> ReductionState::TakeReadySums() {
  std::vector<SumJob> out;
  out.swap(ready_);
  return out;
}

void ReductionState::FinishSum(SumJob job) {
  --sums_in_flight_;
  auto k = keys_.find(job.begin);
  if (k == keys_.end()) {
    // Not reached (Reset waits until no sum is in flight); the job's
    // contributions are let go all the same.
    Key gone;
    Settle(gone, job);
    ReleaseUnheld();
    return;
  }
  Key& key = k->second;
  Settle(key, job);
  key.summing = false;
  // What came for the range meanwhile, summed now as it would have been at
  // once: the waiting run from next_order on holds a copy (an arrival that
  // was not held), or completes the range. Held ones alone stay held.
  bool sum = false;
  uint32_t o = key.next_order;
  for (auto p = key.pending.find(o); p != key.pending.end(); p = key.pending.find(++o)) {
    if (p->second.held == nullptr) sum = true;
  }
  if (sum || (o > key.next_order && o == Expected(micro_batches_))) {
    SumRun(job.begin, key, nullptr, 0, job.grad_scale);
  }
  ReleaseUnheld();
}

bool ReductionState::NextInOrder(const HeldContribution& held) const {
  auto k = keys_.find(held.begin);
  return k != keys_.end() && k->second.next_order == held.order && !k->second.summing;
}

void ReductionState::Unhold(HeldContribution* held, uint64_t reserved_pending, float grad_scale) {
  pending_bytes_ += reserved_pending;
  const uint64_t begin = held->begin;
  const uint32_t order = held->order;
  auto k = keys_.find(begin);
  if (k != keys_.end()) {
    Key& key = k->second;
    auto p = key.pending.find(order);
    if (p != key.pending.end() && p->second.held.get() == held) {
      if (order == key.next_order && !key.summing) {
        SumRun(begin, key, nullptr, 0, grad_scale);
      } else {
        Pending& e = p->second;
        e.bytes.assign(e.data(), e.data() + e.size());
        e.view = {};
        e.held->state = HeldContribution::State::kDone;
        e.held.reset();
        buffered_bytes_ += e.bytes.size();
      }
    }
  }
  ReleaseUnheld();
}

void ReductionState::DropHeld(HeldContribution* held) {
  auto k = keys_.find(held->begin);
  if (k == keys_.end()) return;
  auto p = k->second.pending.find(held->order);
  if (p == k->second.pending.end() || p->second.held.get() != held) return;
  ErasePending(k->second, p, HeldContribution::State::kDropped);
  ReleaseUnheld();
}

void ReductionState::ReleaseUnheld() {
  if (buffered_bytes_ < pending_bytes_) {
    ledger_->Release(options_.job_id, MemoryCategory::kBuffer, pending_bytes_ - buffered_bytes_);
    pending_bytes_ = buffered_bytes_;
  }
  if (const uint64_t now = BookkeepingNow(); now < bookkeeping_bytes_) {
    ledger_->Release(options_.job_id, MemoryCategory::kBuffer, bookkeeping_bytes_ - now);
    bookkeeping_bytes_ = now;
  }
}

GradStats ReductionState::GradStatsOfStep() const {
  GradStats total;
  for (const auto& [b, k] : keys_) {
    total.sum_sq += k.stats.sum_sq;
    total.found_inf_nan = total.found_inf_nan || k.stats.found_inf_nan;
  }
  return total;
}

uint64_t ReductionState::CompleteElements() const {
  const uint32_t expected = Expected(micro_batches_);
  uint64_t total = 0;
  for (const auto& [b, k] : keys_) {
    if (k.next_order == expected) total += k.end - b;
  }
  return total;
}

std::vector<MissingRange> ReductionState::Missing(size_t max) const {
  const uint32_t expected = Expected(micro_batches_);
  const uint32_t mbs = std::max<uint32_t>(micro_batches_, 1);
  std::vector<MissingRange> out;
  uint64_t pos = options_.owned_unpadded.begin;
  auto uncovered = [&](uint64_t until) {
    if (pos < until && out.size() < max) out.push_back({{pos, until}, 0, 0, expected});
  };
  for (const auto& [b, k] : keys_) {
    uncovered(b);
    pos = k.end;
    if (k.next_order < expected && out.size() < max) {
      // The first contribution not in: a held one is in, though not summed.
      uint32_t waiting = k.next_order;
      while (k.pending.count(waiting) > 0) ++waiting;
      const uint32_t rank = options_.mode == ReductionMode::kDaemon ? waiting / mbs : k.partition;
      out.push_back(
          {{b, k.end}, rank, k.next_order + static_cast<uint32_t>(k.pending.size()), expected});
    }
  }
  uncovered(options_.owned_unpadded.end);
  return out;
}

std::string ReductionState::DescribeIncomplete() const {
  const std::vector<MissingRange> missing = Missing(1);
  if (missing.empty()) return "complete";
  const MissingRange& m = missing[0];
  if (m.contributions == 0 && keys_.count(m.range.begin) == 0) {
    return absl::StrCat("range ", RangeString(m.range), " has no gradient yet (",
                        options_.owned_unpadded.size() - CompleteElements(), " of ",
                        options_.owned_unpadded.size(), " owned elements incomplete)");
  }
  return absl::StrCat("range ", RangeString(m.range), " waits for rank ", m.rank, " (",
                      m.contributions, " of ", m.expected, " contributions in)");
}

uint32_t ReductionState::ReplaceRank(uint32_t rank) {
  replacing_.insert(rank);
  if (options_.mode != ReductionMode::kDaemon || micro_batches_ == 0) return 0;
  const uint32_t first = rank * micro_batches_;
  const uint32_t last = first + micro_batches_;
  uint32_t dropped = 0;
  for (auto& [b, k] : keys_) {
    for (auto p = k.pending.lower_bound(first); p != k.pending.end() && p->first < last;) {
      p = ErasePending(k, p, HeldContribution::State::kDropped);
      ++dropped;
    }
  }
  ReleaseUnheld();
  return dropped;
}

void ReductionState::Reset() {
  ready_.clear();  // empty: the caller runs what it plans before letting go
  for (auto& [b, k] : keys_) {
    for (auto& [o, p] : k.pending) {
      if (p.held != nullptr) p.held->state = HeldContribution::State::kDropped;
    }
  }
  keys_.clear();
  std::fill(has_grad_.begin(), has_grad_.end(), 0);
  replacing_.clear();
  micro_batches_ = 0;
  buffered_bytes_ = 0;
  applied_ = 0;
  pending_entries_ = 0;
  pending_marks_bytes_ = 0;
  if (pending_bytes_ + bookkeeping_bytes_ > 0) {
    ledger_->Release(options_.job_id, MemoryCategory::kBuffer, pending_bytes_ + bookkeeping_bytes_);
    pending_bytes_ = 0;
    bookkeeping_bytes_ = 0;
  }
}

void ReductionState::Hash(uint64_t& h) const {
  HashValue(h, micro_batches_);
  for (uint32_t r : replacing_) HashValue(h, r);
  HashValue(h, pending_bytes_);
  Fnv1aMix(h, has_grad_.data(), has_grad_.size());
  for (const auto& [b, k] : keys_) {
    HashValue(h, b);
    HashValue(h, k.end);
    HashValue(h, k.next_order);
    // Only the applied part of the gradient buffer is state.
    if (k.next_order > 0) {
      Fnv1aMix(h, grad_ + (b - options_.owned.begin), (k.end - b) * sizeof(float));
    }
    for (uint32_t crc : k.crcs) HashValue(h, crc);
    for (const auto& [o, p] : k.pending) {
      HashValue(h, o);
      Fnv1aMix(h, p.data(), p.size());
      for (uint32_t t : p.no_grad) HashValue(h, t);
    }
  }
}

}  // namespace zeroshard
