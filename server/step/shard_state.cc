#include "server/step/shard_state.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/fnv.h"
#include "common/status_macros.h"

namespace zeroshard {

StepHyperParams HyperParamsOf(const OptimizerSettings& s) {
  StepHyperParams hp;
  hp.kind = s.kind;
  hp.lr = s.lr;
  hp.beta1 = s.beta1;
  hp.beta2 = s.beta2;
  hp.eps = s.eps;
  hp.weight_decay = s.weight_decay;
  hp.momentum = s.momentum;
  return hp;
}

std::vector<StepHyperParams> GroupHyperParams(const JobSettings& settings) {
  std::vector<StepHyperParams> out;
  for (uint32_t g = 0; g < GroupCount(settings); ++g) {
    out.push_back(HyperParamsOf(GroupOptimizer(settings, g)));
  }
  return out;
}

namespace {

// The half copy is the partitioned parameter only in stage 3; before that it
// stages gathers.
MemoryCategory HalfCategory(const JobConfig& c) {
  return c.stage == 3 ? MemoryCategory::kParamHalf : MemoryCategory::kBuffer;
}

}  // namespace

CategoryBytes BookedAsReplica(const CategoryBytes& bytes) {
  CategoryBytes out{};
  for (uint64_t b : bytes) out[static_cast<int>(MemoryCategory::kReplica)] += b;
  return out;
}

CategoryBytes ShardState::Footprint(const JobConfig& c, FlatRange owned, bool replica) {
  if (replica) return BookedAsReplica(Footprint(c, owned, false));
  const uint64_t n = owned.size();
  const uint64_t moments = n - OwnedTensors(c.layout, owned).frozen_elements();
  CategoryBytes bytes{};
  bytes[static_cast<int>(MemoryCategory::kParamMaster)] = n * sizeof(float);
  bytes[static_cast<int>(MemoryCategory::kOptimM)] = moments * sizeof(float);
  if (c.optimizer.kind != OptimizerKind::kSgdMomentum) {
    bytes[static_cast<int>(MemoryCategory::kOptimV)] = moments * sizeof(float);
  }
  if (c.precision != DType::kFp32) {
    bytes[static_cast<int>(HalfCategory(c))] += n * sizeof(uint16_t);
  }
  return bytes;
}

absl::StatusOr<std::unique_ptr<ShardState>> ShardState::Create(const JobConfig& c, FlatRange owned,
                                                               LedgerReservation* booked,
                                                               transport::Transport* transport,
                                                               bool replica) {
  std::unique_ptr<ShardState> s(
      new ShardState(c.precision, OwnedTensors(c.layout, owned), HalfCategory(c)));
  const uint64_t n = owned.size();
  const uint64_t moment_elements = s->tensors_.moment_elements();
  const bool sgd = c.optimizer.kind == OptimizerKind::kSgdMomentum;
  const bool half = c.precision != DType::kFp32;
  // Checked before any allocation: a region is never allocated for bytes
  // nobody booked.
  const CategoryBytes needed = Footprint(c, owned, replica);
  for (int cat = 0; cat < kNumMemoryCategories; ++cat) {
    if (booked->held(static_cast<MemoryCategory>(cat)) < needed[cat]) {
      return absl::InternalError(absl::StrCat("job ", c.job_id, ": the shard states' ",
                                              MemoryCategoryName(static_cast<MemoryCategory>(cat)),
                                              " bytes were not booked"));
    }
  }
  // Arrays peers read directly (trainers the masters and half copy, in a
  // replicated job a backup every checkpoint array in a state transfer) are
  // allocated by the transport (placed for remote access) and booked once,
  // as the arrays themselves.
  auto remote = [&](size_t size, std::unique_ptr<transport::Region>* region)
      -> absl::StatusOr<void*> {
    if (transport == nullptr || size == 0) return nullptr;
    absl::StatusOr<std::unique_ptr<transport::Region>> r =
        transport->AllocateRegion(size, transport::Access::kRemoteRead);
    if (!r.ok()) return r.status();
    *region = *std::move(r);
    return (*region)->base();
  };
  auto array = [&](auto* out, MemoryCategory category, std::unique_ptr<transport::Region>* region,
                   uint64_t n) -> absl::Status {
    using T = typename std::remove_pointer_t<decltype(out)>::value_type;
    void* memory = nullptr;
    if (region != nullptr) {
      absl::StatusOr<void*> m = remote(n * sizeof(T), region);
      if (!m.ok()) return m.status();
      memory = *m;
    }
    absl::StatusOr<LedgerArray<T>> a =
        LedgerArray<T>::Create(booked, replica ? MemoryCategory::kReplica : category, n, memory);
    if (!a.ok()) return a.status();
    *out = *std::move(a);
    return absl::OkStatus();
  };
  if (absl::Status st = array(&s->master_, MemoryCategory::kParamMaster, &s->master_region_, n);
      !st.ok()) {
    return st;
  }
  // The moments only where a backup may read them.
  const bool replicated = c.replicas > 1;
  if (absl::Status st =
          array(&s->m_, MemoryCategory::kOptimM, replicated ? &s->m_region_ : nullptr,
                moment_elements);
      !st.ok()) {
    return st;
  }
  if (!sgd) {
    if (absl::Status st =
            array(&s->v_, MemoryCategory::kOptimV, replicated ? &s->v_region_ : nullptr,
                  moment_elements);
        !st.ok()) {
      return st;
    }
  }
  if (half) {
    if (absl::Status st = array(&s->half_, HalfCategory(c), &s->half_region_, n); !st.ok()) {
      return st;
    }
  }
  s->tensor_steps_.assign(s->tensors_.entries().size(), 0);
  return s;
}

ShardState::~ShardState() = default;

void ShardState::WriteMasters(ShardOptimizer* optimizer, uint64_t begin, const void* src,
                              DType type, size_t n) {
  optimizer->ConvertIn(master_.data() + (begin - owned_.begin), src, type, n);
}

void ShardState::RefreshHalfCopy(ShardOptimizer* optimizer) {
  if (half_.empty()) return;
  optimizer->ConvertOut(half_.data(), precision_, master_.data(), master_.size());
}

void ShardState::Read(uint64_t begin, size_t n, DType dtype, void* dst) const {
  const uint64_t off = begin - owned_.begin;
  if (dtype == precision_ && !half_.empty()) {
    std::memcpy(dst, half_.data() + off, n * DTypeSize(dtype));
  } else {
    FromFloat(dtype, master_.data() + off, dst, n);
  }
}

absl::Status ShardState::Step(ShardOptimizer* optimizer, absl::Span<const StepHyperParams> groups,
                              const float* grad, const FlatRange& range,
                              absl::Span<const uint32_t> no_grad) {
  for (size_t g = 0; g < groups.size(); ++g) {
    StepHyperParams hp = groups[g];
    hp.step = 1;
    if (absl::Status s = ValidateHyperParams(hp); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("parameter group ", g, ": ", s.message()));
    }
  }
  const std::vector<OwnedTensors::Entry>& entries = tensors_.entries();
  for (const OwnedTensors::Entry& e : entries) {
    if (!e.frozen && e.group >= groups.size()) {
      return absl::InternalError(absl::StrCat("tensor ", e.index, " is in parameter group ",
                                              e.group, " of ", groups.size()));
    }
  }
  // Runs of updated tensors: [run_first, i) share a group and an update count
  // and follow each other with nothing skipped between.
  size_t skip = 0;  // next candidate in no_grad
  auto skipped = [&](uint32_t index) {
    while (skip < no_grad.size() && no_grad[skip] < index) ++skip;
    return skip < no_grad.size() && no_grad[skip] == index;
  };
  // Entry i's span: its elements and the alignment gap after it (the first
  // also the gap before it, the last up to the end of `range`), so that a
  // step of every tensor covers `range` whole.
  auto span_begin = [&](size_t i) { return i == 0 ? range.begin : entries[i].range.begin; };
  auto span_end = [&](size_t i) {
    return i + 1 < entries.size() ? entries[i + 1].range.begin : range.end;
  };
  auto run_step = [&](size_t first, size_t last) -> absl::Status {
    const FlatRange r{span_begin(first), span_end(last - 1)};
    const uint64_t off = r.begin - owned_.begin;
    const uint64_t moment = tensors_.MomentIndex(r.begin);
    StepHyperParams hp = groups[entries[first].group];
    hp.step = static_cast<int64_t>(tensor_steps_[first] + 1);
    ShardBuffers b;
    b.param = master_.data() + off;
    b.grad = grad + off;
    b.exp_avg = m_.data() + moment;
    b.exp_avg_sq = v_.empty() ? nullptr : v_.data() + moment;
    b.model_copy = half_.empty() ? nullptr : half_.data() + off;
    b.model_copy_type = precision_;
    b.size = r.size();
    RETURN_IF_ERROR(optimizer->Step(hp, b));
    for (size_t j = first; j < last; ++j) ++tensor_steps_[j];
    return absl::OkStatus();
  };
  size_t run_first = 0;
  bool in_run = false;
  for (size_t i = 0; i < entries.size(); ++i) {
    const OwnedTensors::Entry& e = entries[i];
    const bool update = !e.frozen && !e.range.empty() && !skipped(e.index);
    const bool joins = in_run && update && e.group == entries[run_first].group &&
                       tensor_steps_[i] == tensor_steps_[run_first];
    if (in_run && !joins) {
      RETURN_IF_ERROR(run_step(run_first, i));
      in_run = false;
    }
    if (update && !in_run) {
      run_first = i;
      in_run = true;
    }
  }
  if (in_run) RETURN_IF_ERROR(run_step(run_first, entries.size()));
  ++optimizer_steps_;
  return absl::OkStatus();
}

void ShardState::CopyOut(size_t n, float* const* dst) const {
  std::memcpy(dst[0], master_.data(), n * sizeof(float));
  const FlatRange range{owned_.begin, owned_.begin + n};
  for (size_t i = 1; i < checkpoint_arrays(); ++i) {
    ReadArray(static_cast<StateArrayKind>(i + 1), range, dst[i]);
  }
}

void ShardState::SetAllSteps(uint64_t optimizer_steps,
                             absl::Span<const v1::TensorStep> tensor_steps) {
  optimizer_steps_ = optimizer_steps;
  const std::vector<OwnedTensors::Entry>& entries = tensors_.entries();
  for (size_t i = 0; i < entries.size(); ++i) {
    tensor_steps_[i] = entries[i].frozen ? 0 : optimizer_steps;
  }
  for (const v1::TensorStep& t : tensor_steps) {
    const int64_t pos = tensors_.Find(t.tensor());
    if (pos >= 0 && !entries[pos].frozen) tensor_steps_[pos] = t.steps();
  }
}

void ShardState::Restore(ShardOptimizer* optimizer, size_t n, const float* const* src,
                         uint64_t optimizer_steps, absl::Span<const v1::TensorStep> tensor_steps) {
  std::memcpy(master_.data(), src[0], n * sizeof(float));
  std::memset(master_.data() + n, 0, (master_.size() - n) * sizeof(float));
  const FlatRange range{owned_.begin, owned_.begin + n};
  for (size_t i = 1; i < checkpoint_arrays(); ++i) {
    LedgerArray<float>& a = i == 1 ? m_ : v_;
    std::memset(a.data(), 0, a.size() * sizeof(float));
    tensors_.ForEachUnfrozen(range, [&](const FlatRange& r) {
      std::memcpy(a.data() + tensors_.MomentIndex(r.begin), src[i] + (r.begin - owned_.begin),
                  r.size() * sizeof(float));
    });
  }
  SetAllSteps(optimizer_steps, tensor_steps);
  RefreshHalfCopy(optimizer);
}

uint64_t ShardState::raw_elements(size_t i, uint64_t n) const {
  if (i == 0) return n;
  uint64_t count = 0;
  tensors_.ForEachUnfrozen({owned_.begin, owned_.begin + n},
                           [&](const FlatRange& r) { count += r.size(); });
  return count;
}

void ShardState::RestoreRaw(ShardOptimizer* optimizer, size_t n, const float* const* src,
                            uint64_t optimizer_steps,
                            absl::Span<const v1::TensorStep> tensor_steps) {
  for (size_t i = 0; i < checkpoint_arrays(); ++i) {
    LedgerArray<float>& a = i == 0 ? master_ : i == 1 ? m_ : v_;
    const uint64_t count = raw_elements(i, n);
    std::memcpy(a.data(), src[i], count * sizeof(float));
    std::memset(a.data() + count, 0, (a.size() - count) * sizeof(float));
  }
  SetAllSteps(optimizer_steps, tensor_steps);
  RefreshHalfCopy(optimizer);
}

absl::Status ShardState::CheckArray(StateArrayKind array, absl::string_view field) const {
  if (array == StateArrayKind::kExpAvgSq && v_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": this job's optimizer keeps no second moment (exp_avg_sq)"));
  }
  return absl::OkStatus();
}

void ShardState::ReadArray(StateArrayKind array, const FlatRange& range, float* dst) const {
  if (array == StateArrayKind::kMaster) {
    std::memcpy(dst, master_.data() + (range.begin - owned_.begin), range.size() * sizeof(float));
    return;
  }
  const LedgerArray<float>& a = moments(array);
  std::memset(dst, 0, range.size() * sizeof(float));
  tensors_.ForEachUnfrozen(range, [&](const FlatRange& r) {
    std::memcpy(dst + (r.begin - range.begin), a.data() + tensors_.MomentIndex(r.begin),
                r.size() * sizeof(float));
  });
}

absl::Status ShardState::CheckWrite(StateArrayKind array, const FlatRange& range,
                                    const float* src, absl::string_view field) const {
  // Every element outside a tensor (gaps) must be zero, and for moments every
  // element of a frozen tensor.
  const bool moments = array != StateArrayKind::kMaster;
  uint64_t pos = range.begin;
  auto must_be_zero = [&](const FlatRange& r, absl::string_view what) -> absl::Status {
    for (uint64_t x = r.begin; x < r.end; ++x) {
      const float v = src[x - range.begin];
      if (v != 0.0f) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ": element ", x, " is ", what, " and must be 0, got ", v));
      }
    }
    return absl::OkStatus();
  };
  const auto [first, last] = tensors_.In(range);
  for (size_t i = first; i < last; ++i) {
    const OwnedTensors::Entry& e = tensors_.entries()[i];
    const FlatRange t = e.range.Intersect(range);
    if (t.begin > pos) RETURN_IF_ERROR(must_be_zero({pos, t.begin}, "an alignment gap"));
    if (moments && e.frozen) {
      RETURN_IF_ERROR(must_be_zero(
          t, absl::StrCat("in frozen tensor ", e.index, ", which holds no optimizer state")));
    }
    pos = t.end;
  }
  if (pos < range.end) RETURN_IF_ERROR(must_be_zero({pos, range.end}, "an alignment gap"));
  return absl::OkStatus();
}

bool ShardState::Holds(StateArrayKind array, const FlatRange& range, const float* src) const {
  if (array == StateArrayKind::kMaster) {
    return std::memcmp(master_.data() + (range.begin - owned_.begin), src,
                       range.size() * sizeof(float)) == 0;
  }
  const LedgerArray<float>& a = moments(array);
  bool same = true;
  tensors_.ForEachUnfrozen(range, [&](const FlatRange& r) {
    same = same && std::memcmp(a.data() + tensors_.MomentIndex(r.begin),
                               src + (r.begin - range.begin), r.size() * sizeof(float)) == 0;
  });
  return same;
}

bool ShardState::HasTensorStep(uint32_t index, uint64_t steps) const {
  return tensor_steps_[tensors_.Find(index)] == steps;
}

void ShardState::WriteArray(ShardOptimizer* optimizer, StateArrayKind array,
                            const FlatRange& range, const float* src) {
  const uint64_t off = range.begin - owned_.begin;
  if (array == StateArrayKind::kMaster) {
    std::memcpy(master_.data() + off, src, range.size() * sizeof(float));
    if (!half_.empty()) {
      optimizer->ConvertOut(half_.data() + off, precision_, master_.data() + off, range.size());
    }
    return;
  }
  LedgerArray<float>& a = array == StateArrayKind::kExpAvg ? m_ : v_;
  tensors_.ForEachUnfrozen(range, [&](const FlatRange& r) {
    std::memcpy(a.data() + tensors_.MomentIndex(r.begin), src + (r.begin - range.begin),
                r.size() * sizeof(float));
  });
}

std::vector<v1::TensorStep> ShardState::TensorStepsIn(const FlatRange& range) const {
  std::vector<v1::TensorStep> out;
  const auto [first, last] = tensors_.In(range);
  for (size_t i = first; i < last; ++i) {
    if (tensors_.entries()[i].frozen) continue;
    v1::TensorStep t;
    t.set_tensor(tensors_.entries()[i].index);
    t.set_steps(tensor_steps_[i]);
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<v1::TensorStep> ShardState::TensorStepsApart() const {
  std::vector<v1::TensorStep> out;
  for (size_t i = 0; i < tensor_steps_.size(); ++i) {
    if (tensors_.entries()[i].frozen || tensor_steps_[i] == optimizer_steps_) continue;
    v1::TensorStep t;
    t.set_tensor(tensors_.entries()[i].index);
    t.set_steps(tensor_steps_[i]);
    out.push_back(std::move(t));
  }
  return out;
}

absl::Status ShardState::CheckTensorStep(uint32_t index, absl::string_view field) const {
  const int64_t pos = tensors_.Find(index);
  if (pos < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": tensor ", index, " does not overlap the range this daemon owns"));
  }
  if (tensors_.entries()[pos].frozen) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": tensor ", index, " is frozen and has no update count"));
  }
  return absl::OkStatus();
}

void ShardState::SetTensorStep(uint32_t index, uint64_t steps) {
  tensor_steps_[tensors_.Find(index)] = steps;
}

void ShardState::Hash(uint64_t& h) const {
  Fnv1aMix(h, master_.data(), master_.size() * sizeof(float));
  Fnv1aMix(h, m_.data(), m_.size() * sizeof(float));
  Fnv1aMix(h, v_.data(), v_.size() * sizeof(float));
  Fnv1aMix(h, half_.data(), half_.size() * sizeof(uint16_t));
  Fnv1aMix(h, &optimizer_steps_, sizeof(optimizer_steps_));
  Fnv1aMix(h, tensor_steps_.data(), tensor_steps_.size() * sizeof(uint64_t));
}

void ShardState::Rebook(bool replica) {
  auto to = [replica](MemoryCategory own) { return replica ? MemoryCategory::kReplica : own; };
  master_.Rebook(to(MemoryCategory::kParamMaster));
  m_.Rebook(to(MemoryCategory::kOptimM));
  v_.Rebook(to(MemoryCategory::kOptimV));
  half_.Rebook(to(half_category_));
}

}  // namespace zeroshard
