#include "server/job.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/fnv.h"

namespace zeroshard {
namespace {

void HashBytes(uint64_t& h, const void* data, size_t n) { Fnv1aMix(h, data, n); }

template <typename T>
void HashValue(uint64_t& h, const T& v) {
  HashBytes(h, &v, sizeof(v));
}

std::string RangeString(const v1::FlatRange& r) {
  return absl::StrCat("[", r.begin(), ", ", r.end(), ")");
}


}  // namespace

Job::Job(JobConfig config, v1::JobSpec spec, uint32_t daemon_index, MemoryLedger* ledger,
         ShardOptimizer* optimizer)
    : config_(std::move(config)),
      spec_(std::move(spec)),
      daemon_index_(daemon_index),
      ledger_(ledger),
      optimizer_(optimizer) {
  owned_partitions_ = config_.map.PartitionsOfDaemon(daemon_index_);
  owned_ = config_.map.DaemonRange(daemon_index_);
  owned_unpadded_ = owned_.Intersect({0, config_.map.total_elements()});
  loss_scale_ = config_.loss_scale.initial_scale;
}

Job::~Job() {
  absl::MutexLock lock(&mu_);
  ResetReduction();
}

absl::StatusOr<std::unique_ptr<Job>> Job::Create(JobConfig config, v1::JobSpec spec,
                                                 uint32_t daemon_index, MemoryLedger* ledger,
                                                 ShardOptimizer* optimizer,
                                                 transport::Transport* transport) {
  if (daemon_index >= config.daemons.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "daemon_index: must be < the number of daemons in spec.daemons (",
        config.daemons.size(), "), got ", daemon_index));
  }
  std::unique_ptr<Job> job(
      new Job(std::move(config), std::move(spec), daemon_index, ledger, optimizer));
  const JobConfig& c = job->config_;
  const uint64_t n = job->owned_.size();
  const bool sgd = c.optimizer.kind == OptimizerKindConfig::kSgdMomentum;
  const bool half = c.precision != DType::kFp32;
  // Check the whole footprint against the limit before allocating anything.
  const uint64_t bytes = n * 4 * (sgd ? 3 : 4) + (half ? n * 2 : 0);
  if (absl::Status s = ledger->CheckFits(c.id, bytes); !s.ok()) return s;
  const std::string& id = c.id;
  // In stage 1 full gradients live on the trainers (the paper's 2Ψ); the
  // daemon's reduction target is a communication buffer. From stage 2 on it
  // is the partitioned gradient. Likewise the half-precision copy is the
  // partitioned parameter only in stage 3; before that it stages gathers.
  const MemoryCategory grad_cat = c.stage >= 2 ? MemoryCategory::kGrad : MemoryCategory::kBuffer;
  const MemoryCategory half_cat =
      c.stage == 3 ? MemoryCategory::kParamHalf : MemoryCategory::kBuffer;
  // With a transport, the arrays trainers read directly are allocated by it
  // (placed for remote access), and booked once, as the arrays themselves.
  auto remote_memory = [&](size_t bytes,
                           std::unique_ptr<transport::Region>* region) -> absl::StatusOr<void*> {
    if (transport == nullptr || bytes == 0) return nullptr;
    absl::StatusOr<std::unique_ptr<transport::Region>> r =
        transport->AllocateRegion(bytes, transport::Access::kRemoteRead);
    if (!r.ok()) return r.status();
    *region = *std::move(r);
    return (*region)->base();
  };
  {
    absl::MutexLock params_lock(&job->params_mu_);
    absl::StatusOr<void*> master_memory = remote_memory(n * sizeof(float), &job->master_region_);
    if (!master_memory.ok()) return master_memory.status();
    absl::StatusOr<LedgerArray<float>> master =
        *master_memory != nullptr
            ? LedgerArray<float>::CreateIn(ledger, id, MemoryCategory::kParamMaster, n,
                                           *master_memory)
            : LedgerArray<float>::Create(ledger, id, MemoryCategory::kParamMaster, n);
    if (!master.ok()) return master.status();
    job->master_ = *std::move(master);
    absl::StatusOr<LedgerArray<float>> m =
        LedgerArray<float>::Create(ledger, id, MemoryCategory::kOptimM, n);
    if (!m.ok()) return m.status();
    job->m_ = *std::move(m);
    if (!sgd) {
      absl::StatusOr<LedgerArray<float>> v =
          LedgerArray<float>::Create(ledger, id, MemoryCategory::kOptimV, n);
      if (!v.ok()) return v.status();
      job->v_ = *std::move(v);
    }
    if (half) {
      absl::StatusOr<void*> half_memory = remote_memory(n * sizeof(uint16_t), &job->half_region_);
      if (!half_memory.ok()) return half_memory.status();
      absl::StatusOr<LedgerArray<uint16_t>> h =
          *half_memory != nullptr
              ? LedgerArray<uint16_t>::CreateIn(ledger, id, half_cat, n, *half_memory)
              : LedgerArray<uint16_t>::Create(ledger, id, half_cat, n);
      if (!h.ok()) return h.status();
      job->half_ = *std::move(h);
    }
  }
  absl::MutexLock lock(&job->mu_);
  absl::StatusOr<LedgerArray<float>> g = LedgerArray<float>::Create(ledger, id, grad_cat, n);
  if (!g.ok()) return g.status();
  job->grad_ = *std::move(g);
  return job;
}

absl::Status Job::Join(const v1::JoinJobRequest& r, uint32_t* ranks_connected,
                       uint64_t* committed_step) {
  auto mismatch = [&](absl::string_view field, auto registered, auto got) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", config_.id, ": ", field, " differs from the registered job (registered ",
        registered, ", rank ", r.rank(), " has ", got, ")"));
  };
  if (r.rank() >= config_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank: must be < world_size (",
                                                   config_.world_size, "), got ", r.rank()));
  }
  if (r.layout_fingerprint() != config_.layout.fingerprint()) {
    return mismatch("layout_fingerprint", config_.layout.fingerprint(), r.layout_fingerprint());
  }
  if (r.stage() != config_.stage) return mismatch("stage", config_.stage, r.stage());
  if (r.world_size() != config_.world_size) {
    return mismatch("world_size", config_.world_size, r.world_size());
  }
  if (r.precision() != DTypeToProto(config_.precision)) {
    return mismatch("precision", DTypeToProto(config_.precision), r.precision());
  }
  absl::MutexLock lock(&mu_);
  ranks_.insert(r.rank());
  *ranks_connected = static_cast<uint32_t>(ranks_.size());
  *committed_step = committed_step_;
  return absl::OkStatus();
}

absl::StatusOr<bool> Job::Leave(uint32_t rank) {
  absl::MutexLock lock(&mu_);
  if (rank >= config_.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: must be < world_size (", config_.world_size, "), got ", rank));
  }
  if (ranks_.erase(rank) == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", config_.id, ": rank ", rank, " has not joined"));
  }
  return ranks_.empty();
}

absl::Status Job::InitParameters(const std::vector<v1::ParameterChunk>& chunks,
                                 uint64_t* elements) {
  // Validate every chunk first.
  std::vector<DType> types;
  types.reserve(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    const v1::ParameterChunk& c = chunks[i];
    const std::string where = absl::StrCat("chunk ", i);
    absl::StatusOr<DType> dt = DTypeFromProto(c.dtype(), where + ".dtype");
    if (!dt.ok()) return dt.status();
    const FlatRange r{c.range().begin(), c.range().end()};
    if (r.begin >= r.end || !owned_unpadded_.Contains(r)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".range ", RangeString(c.range()), " is empty or outside this daemon's ",
          "parameters [", owned_unpadded_.begin, ", ", owned_unpadded_.end, ")"));
    }
    if (c.data().size() != r.size() * DTypeSize(*dt)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".data: ", c.data().size(), " bytes, expected ", r.size() * DTypeSize(*dt),
          " for ", r.size(), " ", DTypeName(*dt), " elements"));
    }
    if (c.crc32c() != 0 && Crc32c(c.data().data(), c.data().size()) != c.crc32c()) {
      return absl::DataLossError(absl::StrCat(where, ": CRC-32C mismatch"));
    }
    types.push_back(*dt);
  }
  {
    absl::MutexLock lock(&mu_);
    if (committed_step_ != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", config_.id, ": initial parameters can only be loaded before the first step ",
          "(step ", committed_step_, " is committed)"));
    }
  }
  absl::MutexLock lock(&params_mu_);
  uint64_t total = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const v1::ParameterChunk& c = chunks[i];
    const uint64_t off = c.range().begin() - owned_.begin;
    const uint64_t n = c.range().end() - c.range().begin();
    optimizer_->ConvertIn(master_.data() + off, c.data().data(), types[i], n);
    total += n;
  }
  RefreshHalfCopy();
  *elements = total;
  return absl::OkStatus();
}

void Job::RefreshHalfCopy() {
  if (half_.empty()) return;
  optimizer_->ConvertOut(half_.data(), config_.precision, master_.data(), master_.size());
}

uint32_t Job::ExpectedContributions() const {
  const uint32_t mb = std::max<uint32_t>(micro_batches_, 1);
  return config_.reduction == ReductionMode::kDaemon ? config_.world_size * mb : mb;
}

absl::Status Job::CheckChunk(const v1::GradientChunk& c, size_t index,
                             absl::string_view payload) const {
  const std::string where = absl::StrCat("chunk ", index);
  if (c.step() != committed_step_ + 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ".step: job ", config_.id, " is computing step ", committed_step_ + 1,
        ", got a gradient for step ", c.step()));
  }
  if (c.rank() >= config_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".rank: must be < world_size (", config_.world_size, "), got ", c.rank()));
  }
  absl::StatusOr<DType> dt = DTypeFromProto(c.dtype(), where + ".dtype");
  if (!dt.ok()) return dt.status();
  if (*dt != DType::kFp32 && *dt != config_.precision) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".dtype: must be fp32 or the job's precision (", DTypeName(config_.precision),
        "), got ", DTypeName(*dt)));
  }
  const FlatRange r{c.range().begin(), c.range().end()};
  if (r.begin >= r.end || !owned_unpadded_.Contains(r)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".range ", RangeString(c.range()), " is empty or outside the partitions this ",
        "daemon owns [", owned_unpadded_.begin, ", ", owned_unpadded_.end, ")"));
  }
  const uint32_t partition = static_cast<uint32_t>(r.begin / config_.map.partition_elements());
  if (!config_.map.Partition(partition).Contains(r)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".range ", RangeString(c.range()), " crosses the boundary of partition ",
        partition, " ", "(split pushes at partition boundaries)"));
  }
  if (config_.reduction == ReductionMode::kTrainerCollective && c.rank() != partition) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": in trainer-collective mode only rank ", partition, " pushes partition ",
        partition, ", got rank ", c.rank()));
  }
  if (payload.size() != r.size() * DTypeSize(*dt)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, c.staged() ? " (staged)" : ".data", ": ", payload.size(), " bytes, expected ",
        r.size() * DTypeSize(*dt), " for ", r.size(), " ", DTypeName(*dt), " elements"));
  }
  const uint32_t mbs = std::max<uint32_t>(c.micro_batches(), 1);
  if (c.micro_batch() >= mbs) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".micro_batch: must be < micro_batches (", mbs, "), got ", c.micro_batch()));
  }
  if (mbs > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".micro_batches: at most 4096, got ", mbs));
  }
  if (micro_batches_ != 0 && mbs != micro_batches_) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ".micro_batches: step ", c.step(), " uses ", micro_batches_,
        " micro-batches per rank, got ", mbs));
  }
  if (c.crc32c() != 0 && Crc32c(payload.data(), payload.size()) != c.crc32c()) {
    return absl::DataLossError(absl::StrCat(where, ": CRC-32C of the data does not match ",
                                            "(corrupted in transit); resend the chunk"));
  }
  return absl::OkStatus();
}

absl::Status Job::PushGradient(const std::vector<v1::GradientChunk>& chunks,
                               const std::vector<absl::string_view>& payloads,
                               v1::PushGradientResponse* response) {
  if (chunks.size() != payloads.size()) {
    return absl::InternalError("PushGradient: one payload per chunk expected");
  }
  if (chunks.empty()) {
    return absl::InvalidArgumentError("PushGradient: the stream carried no chunk");
  }
  absl::MutexLock lock(&mu_);
  // Phase 1: validate every chunk against the request rules and the step's
  // state, as if the earlier chunks of this stream had been applied.
  const uint32_t mbs = std::max<uint32_t>(chunks[0].micro_batches(), 1);
  const uint32_t saved_mbs = micro_batches_;
  struct Planned {
    uint64_t begin, end;
    uint32_t order;
  };
  std::vector<Planned> plan;
  std::map<uint64_t, uint64_t> new_keys;  // begin -> end, keys this stream creates
  std::set<std::pair<uint64_t, uint32_t>> seen;
  uint64_t pending_needed = 0;
  absl::Status status = absl::OkStatus();
  micro_batches_ = micro_batches_ == 0 ? mbs : micro_batches_;
  for (size_t i = 0; i < chunks.size() && status.ok(); ++i) {
    const v1::GradientChunk& c = chunks[i];
    status = CheckChunk(c, i, payloads[i]);
    if (!status.ok()) break;
    const uint64_t b = c.range().begin(), e = c.range().end();
    const uint32_t order = config_.reduction == ReductionMode::kDaemon
                               ? c.rank() * micro_batches_ + c.micro_batch()
                               : c.micro_batch();
    // The key must equal an existing key or not overlap any.
    auto find_conflict = [&](const auto& m) -> std::string {
      auto it = m.upper_bound(b);
      if (it != m.begin()) {
        auto prev = std::prev(it);
        uint64_t prev_end;
        if constexpr (std::is_same_v<std::decay_t<decltype(prev->second)>, KeyState>) {
          prev_end = prev->second.end;
        } else {
          prev_end = prev->second;
        }
        if (prev->first == b && prev_end == e) return "";
        if (prev_end > b) return absl::StrCat("[", prev->first, ", ", prev_end, ")");
      }
      if (it != m.end() && it->first < e) return absl::StrCat("[", it->first, ", ...)");
      return "";
    };
    std::string conflict = find_conflict(keys_);
    if (conflict.empty()) conflict = find_conflict(new_keys);
    if (!conflict.empty()) {
      status = absl::FailedPreconditionError(absl::StrCat(
          "chunk ", i, ".range ", RangeString(c.range()), " overlaps the chunk ", conflict,
          " pushed for this step: every rank must cut its gradients into the same chunks"));
      break;
    }
    auto key = keys_.find(b);
    const bool applied = key != keys_.end() && (order < key->second.next_order ||
                                                key->second.pending.count(order) > 0);
    if (applied || !seen.insert({b, order}).second) {
      status = absl::AlreadyExistsError(absl::StrCat(
          "chunk ", i, ": rank ", c.rank(), " micro-batch ", c.micro_batch(),
          " already pushed range ", RangeString(c.range()), " for step ", c.step(),
          " (a duplicate is never counted twice)"));
      break;
    }
    if (key == keys_.end()) new_keys.emplace(b, e);
    const uint32_t next = key == keys_.end() ? 0 : key->second.next_order;
    if (order != next) pending_needed += (e - b) * sizeof(float);  // upper bound
    plan.push_back({b, e, order});
  }
  if (status.ok() && pending_needed > 0) {
    status = ledger_->Reserve(config_.id, MemoryCategory::kBuffer, pending_needed);
  }
  if (!status.ok()) {
    micro_batches_ = saved_mbs;
    return status;
  }
  // Phase 2: apply.
  pending_bytes_ += pending_needed;
  uint64_t elements = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const v1::GradientChunk& c = chunks[i];
    const Planned& p = plan[i];
    const size_t n = p.end - p.begin;
    auto [it, inserted] = keys_.try_emplace(p.begin);
    if (inserted) {
      it->second.end = p.end;
      it->second.partition = static_cast<uint32_t>(p.begin / config_.map.partition_elements());
    }
    ApplyContribution(it->second, p.begin, p.order, payloads[i].data(),
                      static_cast<DType>(c.dtype()), n);
    elements += n;
  }
  // Give back what the upper bound over-reserved.
  uint64_t still_pending = 0;
  for (const auto& [b, k] : keys_) {
    for (const auto& [o, pc] : k.pending) still_pending += pc.values.size() * sizeof(float);
  }
  if (still_pending < pending_bytes_) {
    ledger_->Release(config_.id, MemoryCategory::kBuffer, pending_bytes_ - still_pending);
    pending_bytes_ = still_pending;
  }
  response->set_elements(elements);
  // A rank is complete when every key has all of its contributions.
  const uint64_t complete = CompleteElements();
  response->set_ranks_complete(complete == owned_unpadded_.size() ? config_.world_size : 0);
  return absl::OkStatus();
}

void Job::ApplyContribution(KeyState& key, uint64_t begin, uint32_t order, const void* src,
                            DType type, size_t n) {
  if (order != key.next_order) {
    std::vector<float>& values = key.pending[order].values;
    values.resize(n);
    optimizer_->ConvertIn(values.data(), src, type, n);
    return;
  }
  AccumulateInto(begin, order, src, type, n);
  ++key.next_order;
  for (auto it = key.pending.find(key.next_order); it != key.pending.end();
       it = key.pending.find(key.next_order)) {
    AccumulateInto(begin, key.next_order, it->second.values.data(), DType::kFp32, n);
    key.pending.erase(it);
    ++key.next_order;
  }
}

void Job::AccumulateInto(uint64_t begin, uint32_t order, const void* src, DType type, size_t n) {
  float* dst = grad_.data() + (begin - owned_.begin);
  // Contribution 0 overwrites: the buffer holds the previous step's sum.
  if (order == 0) {
    optimizer_->ConvertIn(dst, src, type, n);
  } else {
    optimizer_->Accumulate(dst, src, type, n);
  }
}

uint64_t Job::CompleteElements() const {
  const uint32_t expected = ExpectedContributions();
  uint64_t total = 0;
  for (const auto& [b, k] : keys_) {
    if (k.next_order == expected) total += k.end - b;
  }
  return total;
}

std::string Job::DescribeIncomplete() const {
  const uint32_t expected = ExpectedContributions();
  uint64_t covered = 0;
  std::string first;
  for (const auto& [b, k] : keys_) {
    covered += k.end - b;
    if (k.next_order < expected && first.empty()) {
      const uint32_t mbs = std::max<uint32_t>(micro_batches_, 1);
      const uint32_t rank =
          config_.reduction == ReductionMode::kDaemon ? k.next_order / mbs : k.partition;
      first = absl::StrCat("range [", b, ", ", k.end, ") waits for rank ", rank, " (",
                           k.next_order, " of ", expected, " contributions in)");
    }
  }
  if (first.empty() && covered < owned_unpadded_.size()) {
    first = absl::StrCat(owned_unpadded_.size() - covered, " of ", owned_unpadded_.size(),
                         " owned elements have no gradient yet");
  }
  return first;
}

void Job::ResetReduction() {
  keys_.clear();
  micro_batches_ = 0;
  if (pending_bytes_ > 0) {
    ledger_->Release(config_.id, MemoryCategory::kBuffer, pending_bytes_);
    pending_bytes_ = 0;
  }
  prepared_ = false;
}

absl::Status Job::Gather(uint64_t after_step, const FlatRange& range, DType dtype,
                         absl::Time deadline, uint64_t max_chunk_elements,
                         const std::function<bool(v1::ParameterChunk&)>& write) {
  if (range.begin >= range.end || !owned_unpadded_.Contains(range)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "range: [", range.begin, ", ", range.end, ") is empty or outside the parameters this ",
        "daemon owns [", owned_unpadded_.begin, ", ", owned_unpadded_.end, ")"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (after_step > committed_step_ + 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "after_step: job ", config_.id, " has committed step ", committed_step_,
          "; step ", after_step, " cannot be committed before step ", committed_step_ + 1));
    }
    auto committed = [this, after_step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return committed_step_ >= after_step;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&committed), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "job ", config_.id, ": step ", after_step, " was not committed in time (committed: ",
          committed_step_, ")"));
    }
  }
  if (!write) return absl::OkStatus();
  absl::ReaderMutexLock lock(&params_mu_);
  v1::ParameterChunk chunk;
  chunk.set_job_id(config_.id);
  chunk.set_dtype(static_cast<v1::DType>(DTypeToProto(dtype)));
  const size_t esize = DTypeSize(dtype);
  for (uint64_t pos = range.begin; pos < range.end;) {
    const uint64_t end = std::min(range.end, pos + max_chunk_elements);
    const uint64_t n = end - pos;
    const uint64_t off = pos - owned_.begin;
    std::string* data = chunk.mutable_data();
    data->resize(n * esize);
    if (dtype == config_.precision && !half_.empty()) {
      std::memcpy(data->data(), half_.data() + off, n * esize);
    } else {
      FromFloat(dtype, master_.data() + off, data->data(), n);
    }
    chunk.mutable_range()->set_begin(pos);
    chunk.mutable_range()->set_end(end);
    chunk.set_crc32c(Crc32c(data->data(), data->size()));
    if (!write(chunk)) return absl::CancelledError("the gathering client went away");
    pos = end;
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::PrepareStepResponse> Job::PrepareStep(uint64_t step) {
  absl::MutexLock lock(&mu_);
  if (step != committed_step_ + 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step: job ", config_.id, " is computing step ", committed_step_ + 1, ", got ", step));
  }
  if (prepared_) return prepare_result_;
  if (CompleteElements() != owned_unpadded_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", config_.id, " step ", step, ": gradients incomplete: ", DescribeIncomplete()));
  }
  const float scale = 1.0f / (static_cast<float>(config_.world_size) * loss_scale_);
  const uint64_t off = owned_unpadded_.begin - owned_.begin;
  GradStats r = optimizer_->SumSquaresAndFinite(grad_.data() + off, owned_unpadded_.size(), scale);
  prepare_result_.set_grad_sq_sum(r.sum_sq);
  prepare_result_.set_found_inf_nan(r.found_inf_nan);
  prepare_result_.set_elements(owned_unpadded_.size());
  prepare_result_.set_loss_scale(loss_scale_);
  prepared_ = true;
  return prepare_result_;
}

absl::StatusOr<v1::CommitStepResponse> Job::CommitStep(const v1::CommitStepRequest& r) {
  absl::MutexLock lock(&mu_);
  if (r.step() == committed_step_ && committed_step_ > 0) return last_commit_;
  if (r.step() != committed_step_ + 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step: job ", config_.id, " is computing step ", committed_step_ + 1, ", got ",
        r.step()));
  }
  if (!std::isfinite(r.lr()) || r.lr() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lr: must be finite and >= 0, got ", r.lr()));
  }
  const float clip = r.clip_coef() == 0 ? 1.0f : r.clip_coef();
  if (!(clip > 0 && clip <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("clip_coef: must be in (0, 1] (0 means 1), got ", r.clip_coef()));
  }
  if (!r.skip() && CompleteElements() != owned_unpadded_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", config_.id, " step ", r.step(), ": gradients incomplete: ",
        DescribeIncomplete()));
  }
  if (!r.skip()) {
    absl::MutexLock params_lock(&params_mu_);
    absl::Status s = RunOptimizer(
        r.lr(), static_cast<double>(clip) /
                    (static_cast<double>(config_.world_size) * static_cast<double>(loss_scale_)));
    if (!s.ok()) return s;
  }
  // Dynamic loss scaling, identical on every daemon of the job.
  if (config_.loss_scale.dynamic) {
    if (r.skip()) {
      loss_scale_ = std::max(loss_scale_ * config_.loss_scale.backoff_factor, 1e-30f);
      good_steps_ = 0;
    } else if (++good_steps_ >= config_.loss_scale.growth_interval) {
      const float grown = loss_scale_ * config_.loss_scale.growth_factor;
      if (std::isfinite(grown)) loss_scale_ = grown;
      good_steps_ = 0;
    }
  }
  ResetReduction();
  ++committed_step_;
  last_commit_.set_committed_step(committed_step_);
  last_commit_.set_loss_scale(loss_scale_);
  last_commit_.set_skipped(r.skip());
  return last_commit_;
}

absl::Status Job::RunOptimizer(double lr, double grad_scale) {
  StepHyperParams hp;
  switch (config_.optimizer.kind) {
    case OptimizerKindConfig::kAdamW: hp.kind = OptimizerKind::kAdamW; break;
    case OptimizerKindConfig::kAdam: hp.kind = OptimizerKind::kAdam; break;
    case OptimizerKindConfig::kSgdMomentum: hp.kind = OptimizerKind::kSgd; break;
  }
  hp.lr = lr;
  hp.beta1 = config_.optimizer.beta1;
  hp.beta2 = config_.optimizer.beta2;
  hp.eps = config_.optimizer.eps;
  hp.weight_decay = config_.optimizer.weight_decay;
  hp.momentum = config_.optimizer.momentum;
  hp.step = static_cast<int64_t>(optimizer_steps_ + 1);
  hp.grad_scale = grad_scale;
  ShardBuffers b;
  b.param = master_.data();
  b.grad = grad_.data();
  b.exp_avg = m_.data();
  b.exp_avg_sq = v_.empty() ? nullptr : v_.data();
  b.model_copy = half_.empty() ? nullptr : half_.data();
  b.model_copy_type = config_.precision;
  // Only real elements: the padding tail stays zero.
  const uint64_t off = owned_unpadded_.begin - owned_.begin;
  b.param += off;
  b.grad += off;
  b.exp_avg += off;
  if (b.exp_avg_sq != nullptr) b.exp_avg_sq += off;
  if (b.model_copy != nullptr) b.model_copy = static_cast<uint16_t*>(b.model_copy) + off;
  b.size = owned_unpadded_.size();
  if (absl::Status s = optimizer_->Step(hp, b); !s.ok()) return s;
  ++optimizer_steps_;
  return absl::OkStatus();
}

void Job::FillParameterRegions(v1::ExchangeEndpointResponse* response) const {
  auto add = [&](const char* purpose, const transport::Region* region) {
    if (region == nullptr) return;
    v1::RemoteRegion* r = response->add_regions();
    r->set_purpose(purpose);
    r->set_address(region->Descriptor().address);
    r->set_length(region->Descriptor().length);
    r->set_rkey(region->Descriptor().rkey);
    r->mutable_range()->set_begin(owned_.begin);
    r->mutable_range()->set_end(owned_.end);
  };
  add("param_master", master_region_.get());
  add("param_half", half_region_.get());
}

uint64_t Job::committed_step() const {
  absl::MutexLock lock(&mu_);
  return committed_step_;
}

uint32_t Job::ranks_connected() const {
  absl::MutexLock lock(&mu_);
  return static_cast<uint32_t>(ranks_.size());
}

float Job::loss_scale() const {
  absl::MutexLock lock(&mu_);
  return loss_scale_;
}

uint64_t Job::StateHash() const {
  absl::MutexLock lock(&mu_);
  absl::ReaderMutexLock params_lock(&params_mu_);
  uint64_t h = kFnv1aOffset;
  HashBytes(h, master_.data(), master_.size() * sizeof(float));
  HashBytes(h, m_.data(), m_.size() * sizeof(float));
  HashBytes(h, v_.data(), v_.size() * sizeof(float));
  HashBytes(h, half_.data(), half_.size() * sizeof(uint16_t));
  HashValue(h, optimizer_steps_);
  HashValue(h, committed_step_);
  HashValue(h, loss_scale_);
  HashValue(h, good_steps_);
  HashValue(h, micro_batches_);
  HashValue(h, pending_bytes_);
  for (const auto& [b, k] : keys_) {
    HashValue(h, b);
    HashValue(h, k.end);
    HashValue(h, k.next_order);
    // Only the applied part of the gradient buffer is state.
    if (k.next_order > 0) HashBytes(h, grad_.data() + (b - owned_.begin), (k.end - b) * 4);
    for (const auto& [o, pc] : k.pending) {
      HashValue(h, o);
      HashBytes(h, pc.values.data(), pc.values.size() * sizeof(float));
    }
  }
  for (uint32_t r : ranks_) HashValue(h, r);
  return h;
}

}  // namespace zeroshard
