#include "server/job_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_id.h"
#include "google/protobuf/util/message_differencer.h"

namespace zeroshard {
namespace {

absl::Status Invalid(absl::string_view field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

}  // namespace

absl::StatusOr<Layout> LayoutFromProto(const v1::Layout& layout) {
  std::vector<TensorSpec> specs;
  specs.reserve(layout.tensors_size());
  for (int i = 0; i < layout.tensors_size(); ++i) {
    const v1::TensorSpec& t = layout.tensors(i);
    absl::StatusOr<DType> dtype =
        DTypeFromProto(t.dtype(), absl::StrCat("spec.layout.tensors[", i, "].dtype"));
    if (!dtype.ok()) return dtype.status();
    specs.push_back(TensorSpec{t.name(), {t.shape().begin(), t.shape().end()}, *dtype, t.layer()});
  }
  absl::StatusOr<Layout> out = Layout::Create(std::move(specs), layout.alignment_elements());
  if (!out.ok()) {
    return absl::Status(out.status().code(), absl::StrCat("spec.layout.", out.status().message()));
  }
  return out;
}

v1::Layout LayoutToProto(const Layout& layout) {
  v1::Layout out;
  out.set_alignment_elements(static_cast<uint32_t>(layout.alignment()));
  for (const TensorPlacement& t : layout.tensors()) {
    v1::TensorSpec* s = out.add_tensors();
    s->set_name(t.spec.name);
    for (int64_t d : t.spec.shape) s->add_shape(d);
    s->set_dtype(static_cast<v1::DType>(DTypeToProto(t.spec.dtype)));
    s->set_layer(t.spec.layer);
  }
  return out;
}

absl::StatusOr<JobConfig> ParseJobSpec(const v1::JobSpec& spec) {
  JobConfig c;
  if (!IsValidJobId(spec.job_id())) {
    return Invalid("spec.job_id", absl::StrCat("must be ", kJobIdRule, ", got \"",
                                               spec.job_id().substr(0, 140), "\""));
  }
  c.id = spec.job_id();
  absl::StatusOr<Layout> layout = LayoutFromProto(spec.layout());
  if (!layout.ok()) return layout.status();
  if (spec.layout_fingerprint() != layout->fingerprint()) {
    return Invalid("spec.layout_fingerprint",
                   absl::StrCat("does not match the layout (got ", spec.layout_fingerprint(),
                                ", the layout hashes to ", layout->fingerprint(),
                                "): the trainer and daemon disagree on the layout"));
  }
  if (spec.stage() < 1 || spec.stage() > 3) {
    return Invalid("spec.stage",
                   absl::StrCat("must be 1, 2 or 3 (stage 0 keeps all model states on the "
                                "trainers and needs no daemon), got ",
                                spec.stage()));
  }
  c.stage = spec.stage();
  if (spec.world_size() < 1 || spec.world_size() > PartitionMap::kMaxWorldSize) {
    return Invalid("spec.world_size", absl::StrCat("N_d must be in 1..",
                                                   PartitionMap::kMaxWorldSize, ", got ",
                                                   spec.world_size()));
  }
  c.world_size = spec.world_size();
  absl::StatusOr<DType> precision = DTypeFromProto(spec.precision(), "spec.precision");
  if (!precision.ok()) return precision.status();
  c.precision = *precision;
  if (spec.reduction() != v1::REDUCTION_MODE_DAEMON &&
      spec.reduction() != v1::REDUCTION_MODE_TRAINER_COLLECTIVE) {
    return Invalid("spec.reduction",
                   absl::StrCat("must be REDUCTION_MODE_DAEMON (1) or "
                                "REDUCTION_MODE_TRAINER_COLLECTIVE (2), got ",
                                spec.reduction()));
  }
  c.reduction = static_cast<ReductionMode>(spec.reduction());

  const v1::OptimizerConfig& o = spec.optimizer();
  if (o.kind() < v1::OPTIMIZER_KIND_ADAMW || o.kind() > v1::OPTIMIZER_KIND_SGD_MOMENTUM) {
    return Invalid("spec.optimizer.kind",
                   absl::StrCat("must be ADAMW (1), ADAM (2) or SGD_MOMENTUM (3), got ", o.kind()));
  }
  c.optimizer.kind = static_cast<OptimizerKindConfig>(o.kind());
  if (!std::isfinite(o.lr()) || o.lr() < 0) {
    return Invalid("spec.optimizer.lr", absl::StrCat("must be finite and >= 0, got ", o.lr()));
  }
  c.optimizer.lr = o.lr();
  if (c.optimizer.kind != OptimizerKindConfig::kSgdMomentum) {
    if (!(o.beta1() >= 0 && o.beta1() < 1)) {
      return Invalid("spec.optimizer.beta1", absl::StrCat("must be in [0, 1), got ", o.beta1()));
    }
    if (!(o.beta2() >= 0 && o.beta2() < 1)) {
      return Invalid("spec.optimizer.beta2", absl::StrCat("must be in [0, 1), got ", o.beta2()));
    }
    if (!(o.eps() > 0) || !std::isfinite(o.eps())) {
      return Invalid("spec.optimizer.eps", absl::StrCat("must be finite and > 0, got ", o.eps()));
    }
  } else if (!(o.momentum() >= 0 && o.momentum() < 1)) {
    return Invalid("spec.optimizer.momentum",
                   absl::StrCat("must be in [0, 1), got ", o.momentum()));
  }
  if (!std::isfinite(o.weight_decay()) || o.weight_decay() < 0) {
    return Invalid("spec.optimizer.weight_decay",
                   absl::StrCat("must be finite and >= 0, got ", o.weight_decay()));
  }
  c.optimizer.beta1 = o.beta1();
  c.optimizer.beta2 = o.beta2();
  c.optimizer.eps = o.eps();
  c.optimizer.weight_decay = o.weight_decay();
  c.optimizer.momentum = o.momentum();

  const v1::LossScaleConfig& ls = spec.loss_scale();
  c.loss_scale.dynamic = ls.dynamic();
  c.loss_scale.initial_scale = ls.initial_scale() == 0 ? 1.0f : ls.initial_scale();
  if (!std::isfinite(c.loss_scale.initial_scale) || c.loss_scale.initial_scale <= 0) {
    return Invalid("spec.loss_scale.initial_scale",
                   absl::StrCat("must be finite and > 0, got ", ls.initial_scale()));
  }
  if (ls.dynamic()) {
    if (ls.growth_interval() < 1) {
      return Invalid("spec.loss_scale.growth_interval", "must be >= 1 with dynamic scaling");
    }
    if (!(ls.growth_factor() > 1) || !std::isfinite(ls.growth_factor())) {
      return Invalid("spec.loss_scale.growth_factor",
                     absl::StrCat("must be finite and > 1, got ", ls.growth_factor()));
    }
    if (!(ls.backoff_factor() > 0 && ls.backoff_factor() < 1)) {
      return Invalid("spec.loss_scale.backoff_factor",
                     absl::StrCat("must be in (0, 1), got ", ls.backoff_factor()));
    }
    c.loss_scale.growth_interval = ls.growth_interval();
    c.loss_scale.growth_factor = ls.growth_factor();
    c.loss_scale.backoff_factor = ls.backoff_factor();
  }

  c.bucket_bytes = spec.bucket_bytes() == 0 ? kDefaultBucketBytes : spec.bucket_bytes();
  if (c.bucket_bytes < 4096 || c.bucket_bytes > (1ull << 30)) {
    return Invalid("spec.bucket_bytes",
                   absl::StrCat("must be in 4 KiB..1 GiB, got ", spec.bucket_bytes()));
  }
  if (spec.daemons_size() < 1 || static_cast<uint32_t>(spec.daemons_size()) > c.world_size) {
    return Invalid("spec.daemons", absl::StrCat("needs 1..world_size (", c.world_size,
                                                ") addresses, got ", spec.daemons_size()));
  }
  for (int i = 0; i < spec.daemons_size(); ++i) {
    const std::string& d = spec.daemons(i);
    if (d.empty() || d.size() > 256 || d.find(':') == std::string::npos) {
      return Invalid(absl::StrCat("spec.daemons[", i, "]"),
                     absl::StrCat("must be HOST:PORT, got \"", d.substr(0, 260), "\""));
    }
    c.daemons.push_back(d);
  }
  absl::StatusOr<PartitionMap> map =
      PartitionMap::Create(layout->total_elements(), c.world_size, spec.daemons_size());
  if (!map.ok()) return map.status();
  c.layout = *std::move(layout);
  c.map = *map;
  return c;
}

std::string DescribeSpecDifference(const v1::JobSpec& registered, const v1::JobSpec& got) {
  auto differ = [](absl::string_view field, auto a, auto b) -> std::string {
    return absl::StrCat(field, ": registered ", a, ", got ", b);
  };
  if (registered.layout_fingerprint() != got.layout_fingerprint()) {
    return differ("layout_fingerprint", registered.layout_fingerprint(), got.layout_fingerprint());
  }
  if (registered.stage() != got.stage()) return differ("stage", registered.stage(), got.stage());
  if (registered.world_size() != got.world_size()) {
    return differ("world_size", registered.world_size(), got.world_size());
  }
  if (registered.precision() != got.precision()) {
    return differ("precision", registered.precision(), got.precision());
  }
  if (registered.reduction() != got.reduction()) {
    return differ("reduction", registered.reduction(), got.reduction());
  }
  if (registered.bucket_bytes() != got.bucket_bytes()) {
    return differ("bucket_bytes", registered.bucket_bytes(), got.bucket_bytes());
  }
  if (!google::protobuf::util::MessageDifferencer::Equals(registered.optimizer(),
                                                          got.optimizer())) {
    return differ("optimizer", registered.optimizer().ShortDebugString(),
                  got.optimizer().ShortDebugString());
  }
  if (!google::protobuf::util::MessageDifferencer::Equals(registered.loss_scale(),
                                                          got.loss_scale())) {
    return differ("loss_scale", registered.loss_scale().ShortDebugString(),
                  got.loss_scale().ShortDebugString());
  }
  const std::string a = absl::StrJoin(registered.daemons(), ",");
  const std::string b = absl::StrJoin(got.daemons(), ",");
  if (a != b) return differ("daemons", a, b);
  if (!google::protobuf::util::MessageDifferencer::Equals(registered.layout(), got.layout())) {
    return "layout: registered and requested layouts differ";
  }
  return "";
}

uint64_t DaemonModelStateFormulaBytes(const JobConfig& config, uint64_t owned_elements) {
  const uint64_t k = config.optimizer.kind == OptimizerKindConfig::kSgdMomentum ? 8 : 12;
  uint64_t per = k;
  if (config.stage >= 2) per += 4;
  if (config.stage == 3 && config.precision != DType::kFp32) per += 2;
  return per * owned_elements;
}

}  // namespace zeroshard
