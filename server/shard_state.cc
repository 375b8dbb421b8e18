#include "server/shard_state.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/fnv.h"

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

CategoryBytes ShardState::Footprint(const JobConfig& c, uint64_t n, bool replica) {
  if (replica) return BookedAsReplica(Footprint(c, n, false));
  CategoryBytes bytes{};
  bytes[static_cast<int>(MemoryCategory::kParamMaster)] = n * sizeof(float);
  bytes[static_cast<int>(MemoryCategory::kOptimM)] = n * sizeof(float);
  if (c.optimizer.kind != OptimizerKind::kSgdMomentum) {
    bytes[static_cast<int>(MemoryCategory::kOptimV)] = n * sizeof(float);
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
  std::unique_ptr<ShardState> s(new ShardState(c.precision, owned, HalfCategory(c)));
  const uint64_t n = owned.size();
  const bool sgd = c.optimizer.kind == OptimizerKind::kSgdMomentum;
  const bool half = c.precision != DType::kFp32;
  // Checked before any allocation: a region is never allocated for bytes
  // nobody booked.
  const CategoryBytes needed = Footprint(c, n, replica);
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
  auto array = [&](auto* out, MemoryCategory category, std::unique_ptr<transport::Region>* region)
      -> absl::Status {
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
  if (absl::Status st = array(&s->master_, MemoryCategory::kParamMaster, &s->master_region_);
      !st.ok()) {
    return st;
  }
  // The moments only where a backup may read them.
  const bool replicated = c.replicas > 1;
  if (absl::Status st =
          array(&s->m_, MemoryCategory::kOptimM, replicated ? &s->m_region_ : nullptr);
      !st.ok()) {
    return st;
  }
  if (!sgd) {
    if (absl::Status st =
            array(&s->v_, MemoryCategory::kOptimV, replicated ? &s->v_region_ : nullptr);
        !st.ok()) {
      return st;
    }
  }
  if (half) {
    if (absl::Status st = array(&s->half_, HalfCategory(c), &s->half_region_); !st.ok()) {
      return st;
    }
  }
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

absl::Status ShardState::Step(ShardOptimizer* optimizer, StepHyperParams hp, const float* grad,
                              const FlatRange& range) {
  hp.step = static_cast<int64_t>(optimizer_steps_ + 1);
  const uint64_t off = range.begin - owned_.begin;
  ShardBuffers b;
  b.param = master_.data() + off;
  b.grad = grad + off;
  b.exp_avg = m_.data() + off;
  b.exp_avg_sq = v_.empty() ? nullptr : v_.data() + off;
  b.model_copy = half_.empty() ? nullptr : half_.data() + off;
  b.model_copy_type = precision_;
  b.size = range.size();
  if (absl::Status s = optimizer->Step(hp, b); !s.ok()) return s;
  ++optimizer_steps_;
  return absl::OkStatus();
}

void ShardState::CopyOut(size_t n, float* const* dst) const {
  const LedgerArray<float>* arrays[] = {&master_, &m_, &v_};
  for (size_t i = 0; i < checkpoint_arrays(); ++i) {
    std::memcpy(dst[i], arrays[i]->data(), n * sizeof(float));
  }
}

void ShardState::Restore(ShardOptimizer* optimizer, size_t n, const float* const* src,
                         uint64_t optimizer_steps) {
  LedgerArray<float>* arrays[] = {&master_, &m_, &v_};
  for (size_t i = 0; i < checkpoint_arrays(); ++i) {
    std::memcpy(arrays[i]->data(), src[i], n * sizeof(float));
    std::memset(arrays[i]->data() + n, 0, (arrays[i]->size() - n) * sizeof(float));
  }
  optimizer_steps_ = optimizer_steps;
  RefreshHalfCopy(optimizer);
}

void ShardState::FillRegions(v1::ExchangeEndpointResponse* response) const {
  auto add = [&](v1::RegionPurpose purpose, const transport::Region* region) {
    if (region == nullptr) return;
    v1::RemoteRegion* r = response->add_regions();
    r->set_purpose(purpose);
    r->set_address(region->Descriptor().address);
    r->set_length(region->Descriptor().length);
    r->set_rkey(region->Descriptor().rkey);
    r->mutable_range()->set_begin(owned_.begin);
    r->mutable_range()->set_end(owned_.end);
  };
  add(v1::REGION_PURPOSE_PARAM_MASTER, master_region_.get());
  add(v1::REGION_PURPOSE_PARAM_HALF, half_region_.get());
}

void ShardState::Hash(uint64_t& h) const {
  Fnv1aMix(h, master_.data(), master_.size() * sizeof(float));
  Fnv1aMix(h, m_.data(), m_.size() * sizeof(float));
  Fnv1aMix(h, v_.data(), v_.size() * sizeof(float));
  Fnv1aMix(h, half_.data(), half_.size() * sizeof(uint16_t));
  Fnv1aMix(h, &optimizer_steps_, sizeof(optimizer_steps_));
}

void ShardState::Rebook(bool replica) {
  auto to = [replica](MemoryCategory own) { return replica ? MemoryCategory::kReplica : own; };
  master_.Rebook(to(MemoryCategory::kParamMaster));
  m_.Rebook(to(MemoryCategory::kOptimM));
  v_.Rebook(to(MemoryCategory::kOptimV));
  half_.Rebook(to(half_category_));
}

}  // namespace zeroshard
