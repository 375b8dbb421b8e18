#include "common/job_spec.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_id.h"
#include "google/protobuf/util/message_differencer.h"

namespace zeroshard {
namespace {

absl::Status Invalid(absl::string_view prefix, absl::string_view field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(prefix, field, ": ", what));
}

bool Finite(float v) { return std::isfinite(v); }

// A layout's tensors, at most, and the bytes of all their names together. A
// daemon keeps a job's spec and placed layout for the job's lifetime outside
// the ledger, so these bound what one RegisterJob makes it hold besides the
// booked model states (about 250 bytes per tensor plus the names twice:
// under 50 MB a job). Real models have thousands of tensors (GPT-3: about
// 1200; a mixture of experts with a tensor per expert, tens of thousands).
constexpr int kMaxLayoutTensors = 1 << 17;
constexpr uint64_t kMaxLayoutNameBytes = uint64_t{8} << 20;

}  // namespace

absl::string_view OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW: return "adamw";
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kSgdMomentum: return "sgd_momentum";
  }
  return "unknown";
}

bool IsUnixSocketAddress(absl::string_view address) {
  return absl::StartsWith(address, kUnixSocketPrefix);
}

absl::Status ValidateHostPort(absl::string_view address, absl::string_view field) {
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": must be HOST:PORT or unix:/ABSOLUTE/PATH, got \"",
                     address.substr(0, kMaxAddressBytes + 4), "\""));
  };
  if (address.empty() || address.size() > kMaxAddressBytes) return bad();
  if (IsUnixSocketAddress(address)) {
    const absl::string_view path = address.substr(sizeof(kUnixSocketPrefix) - 1);
    if (path.size() < 2 || path.front() != '/') return bad();
    if (path.size() > kMaxUnixSocketPathBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": the socket path ", path, " has ", path.size(), " bytes; a unix socket's path ",
          "may have ", kMaxUnixSocketPathBytes, " at most (choose a shorter directory)"));
    }
    for (char ch : path) {
      if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f || ch == ',') return bad();
    }
    return absl::OkStatus();
  }
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) return bad();
  const absl::string_view host = address.substr(0, colon);
  const absl::string_view port = address.substr(colon + 1);
  if (port.empty() || port.size() > 5) return bad();
  for (char ch : port) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(ch))) return bad();
  }
  // A bare IPv6 address would put its own colons before the port.
  if (host.find(':') != absl::string_view::npos && (host.front() != '[' || host.back() != ']')) {
    return bad();
  }
  return absl::OkStatus();
}

namespace {

// The hyper-parameters a kind uses, checked (`field` is e.g. "optimizer." or
// "param_groups[2].").
absl::Status CheckHyperParams(absl::string_view p, const std::string& field, OptimizerKind kind,
                              float lr, float beta1, float beta2, float eps, float weight_decay) {
  if (!Finite(lr) || lr < 0) {
    return Invalid(p, field + "lr", absl::StrCat("must be finite and >= 0, got ", lr));
  }
  if (kind != OptimizerKind::kSgdMomentum) {
    if (!(beta1 >= 0 && beta1 < 1)) {
      return Invalid(p, field + "beta1", absl::StrCat("must be in [0, 1), got ", beta1));
    }
    if (!(beta2 >= 0 && beta2 < 1)) {
      return Invalid(p, field + "beta2", absl::StrCat("must be in [0, 1), got ", beta2));
    }
    if (!(eps > 0) || !Finite(eps)) {
      return Invalid(p, field + "eps", absl::StrCat("must be finite and > 0, got ", eps));
    }
  }
  if (!Finite(weight_decay) || weight_decay < 0) {
    return Invalid(p, field + "weight_decay",
                   absl::StrCat("must be finite and >= 0, got ", weight_decay));
  }
  return absl::OkStatus();
}

}  // namespace

OptimizerSettings GroupOptimizer(const JobSettings& s, uint32_t group) {
  OptimizerSettings o = s.optimizer;
  if (group < s.param_groups.size()) {
    const ParamGroupSettings& g = s.param_groups[group];
    o.lr = g.lr;
    o.beta1 = g.beta1;
    o.beta2 = g.beta2;
    o.eps = g.eps;
    o.weight_decay = g.weight_decay;
  }
  return o;
}

absl::Status ValidateLayoutGroups(const JobSettings& s, const Layout& layout,
                                  absl::string_view prefix) {
  const uint32_t groups = GroupCount(s);
  for (size_t i = 0; i < layout.tensors().size(); ++i) {
    const TensorSpec& t = layout.tensors()[i].spec;
    if (t.group >= groups) {
      return absl::InvalidArgumentError(absl::StrCat(
          prefix, "layout.tensors[", i, "].group (", t.name, "): the job has ", groups,
          " parameter group", groups == 1 ? "" : "s", ", got group ", t.group));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateJobSettings(const JobSettings& s, absl::string_view p) {
  if (!IsValidJobId(s.job_id)) {
    return Invalid(p, "job_id",
                   absl::StrCat("must be ", kJobIdRule, ", got \"", s.job_id.substr(0, 140), "\""));
  }
  if (s.stage < 1 || s.stage > 3) {
    return Invalid(p, "stage",
                   absl::StrCat("must be 1, 2 or 3 (stage 0 keeps all model states on the "
                                "trainers and needs no daemon), got ",
                                s.stage));
  }
  if (s.world_size < 1 || s.world_size > PartitionMap::kMaxWorldSize) {
    return Invalid(p, "world_size", absl::StrCat("N_d must be in 1..", PartitionMap::kMaxWorldSize,
                                                 ", got ", s.world_size));
  }
  if (s.precision != DType::kFp32 && s.precision != DType::kBf16 &&
      s.precision != DType::kFp16) {
    return Invalid(p, "precision", absl::StrCat("unknown dtype ", static_cast<int>(s.precision)));
  }
  if (s.reduction != ReductionMode::kDaemon && s.reduction != ReductionMode::kTrainerCollective) {
    return Invalid(p, "reduction",
                   absl::StrCat("must be DAEMON (1) or TRAINER_COLLECTIVE (2), got ",
                                static_cast<int>(s.reduction)));
  }
  const OptimizerSettings& o = s.optimizer;
  if (o.kind != OptimizerKind::kAdamW && o.kind != OptimizerKind::kAdam &&
      o.kind != OptimizerKind::kSgdMomentum) {
    return Invalid(p, "optimizer.kind",
                   absl::StrCat("must be ADAMW (1), ADAM (2) or SGD_MOMENTUM (3), got ",
                                static_cast<int>(o.kind)));
  }
  if (absl::Status st = CheckHyperParams(p, "optimizer.", o.kind, o.lr, o.beta1, o.beta2, o.eps,
                                         o.weight_decay);
      !st.ok()) {
    return st;
  }
  if (o.kind == OptimizerKind::kSgdMomentum && !(o.momentum >= 0 && o.momentum < 1)) {
    return Invalid(p, "optimizer.momentum", absl::StrCat("must be in [0, 1), got ", o.momentum));
  }
  if (s.param_groups.size() > Layout::kMaxParamGroups) {
    return Invalid(p, "param_groups",
                   absl::StrCat("at most ", Layout::kMaxParamGroups, ", got ", s.param_groups.size()));
  }
  for (size_t g = 0; g < s.param_groups.size(); ++g) {
    const ParamGroupSettings& pg = s.param_groups[g];
    if (absl::Status st = CheckHyperParams(p, absl::StrCat("param_groups[", g, "]."), o.kind, pg.lr,
                                           pg.beta1, pg.beta2, pg.eps, pg.weight_decay);
        !st.ok()) {
      return st;
    }
  }
  const LossScaleSettings& ls = s.loss_scale;
  if (!Finite(ls.initial_scale) || ls.initial_scale <= 0) {
    return Invalid(p, "loss_scale.initial_scale",
                   absl::StrCat("must be finite and > 0, got ", ls.initial_scale));
  }
  if (ls.dynamic) {
    if (ls.growth_interval < 1) {
      return Invalid(p, "loss_scale.growth_interval", "must be >= 1 with dynamic scaling");
    }
    if (!(ls.growth_factor > 1) || !Finite(ls.growth_factor)) {
      return Invalid(p, "loss_scale.growth_factor",
                     absl::StrCat("must be finite and > 1, got ", ls.growth_factor));
    }
    if (!(ls.backoff_factor > 0 && ls.backoff_factor < 1)) {
      return Invalid(p, "loss_scale.backoff_factor",
                     absl::StrCat("must be in (0, 1), got ", ls.backoff_factor));
    }
  }
  if (s.bucket_bytes < kMinBucketBytes || s.bucket_bytes > kMaxBucketBytes) {
    return Invalid(p, "bucket_bytes",
                   absl::StrCat("must be in 4 KiB..1 GiB, got ", s.bucket_bytes));
  }
  if (s.daemons.empty() || s.daemons.size() > s.world_size) {
    return Invalid(p, "daemons", absl::StrCat("needs 1..world_size (", s.world_size,
                                              ") addresses, got ", s.daemons.size()));
  }
  if (s.replicas < 1 || s.replicas > 2) {
    return Invalid(p, "replicas", absl::StrCat("must be 1 or 2, got ", s.replicas));
  }
  if (s.replicas == 2 && s.daemons.size() < 2) {
    return Invalid(p, "replicas",
                   "2 needs at least 2 daemons (each replica group's backup is the next daemon)");
  }
  if (s.node_cache && s.replicas > 1) {
    return Invalid(p, "node_cache",
                   "needs replicas = 1 (a replicated job's gathers name their replica group)");
  }
  for (size_t i = 0; i < s.daemons.size(); ++i) {
    const std::string field = absl::StrCat(p, "daemons[", i, "]");
    if (absl::Status st = ValidateHostPort(s.daemons[i], field); !st.ok()) return st;
    for (size_t j = 0; j < i; ++j) {
      if (s.daemons[j] == s.daemons[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ": \"", s.daemons[i], "\" is listed twice"));
      }
    }
  }
  return absl::OkStatus();
}

v1::DType WireDType(DType t) { return static_cast<v1::DType>(DTypeToProto(t)); }

void FillPartitionMap(const JobConfig& c, v1::PartitionMap* m) {
  m->set_total_elements(c.map.total_elements());
  m->set_padded_elements(c.map.padded_elements());
  m->set_partition_elements(c.map.partition_elements());
  for (uint32_t i = 0; i < c.world_size; ++i) {
    v1::Partition* p = m->add_partitions();
    p->set_index(i);
    p->mutable_range()->set_begin(c.map.Partition(i).begin);
    p->mutable_range()->set_end(c.map.Partition(i).end);
    p->set_daemon_address(c.daemons[c.map.DaemonOf(i)]);
  }
}

absl::StatusOr<Layout> LayoutFromProto(const v1::Layout& layout) {
  // Bounded before anything is copied out of the message.
  if (layout.tensors_size() > kMaxLayoutTensors) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.layout.tensors: at most ", kMaxLayoutTensors, " tensors, got ",
                     layout.tensors_size(), " (group small tensors into larger ones)"));
  }
  uint64_t name_bytes = 0;
  for (int i = 0; i < layout.tensors_size(); ++i) {
    const v1::TensorSpec& t = layout.tensors(i);
    if (t.shape_size() > static_cast<int>(Layout::kMaxDims)) {
      return absl::InvalidArgumentError(absl::StrCat("spec.layout.tensors[", i,
                                                     "].shape: needs 1..", Layout::kMaxDims,
                                                     " dimensions, got ", t.shape_size()));
    }
    name_bytes += t.name().size();
    for (const std::string& a : t.aliases()) name_bytes += a.size();
  }
  if (name_bytes > kMaxLayoutNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("spec.layout.tensors: the names take ",
                                                   name_bytes, " bytes together, at most ",
                                                   kMaxLayoutNameBytes, " are accepted"));
  }
  std::vector<TensorSpec> specs;
  specs.reserve(layout.tensors_size());
  for (int i = 0; i < layout.tensors_size(); ++i) {
    const v1::TensorSpec& t = layout.tensors(i);
    absl::StatusOr<DType> dtype =
        DTypeFromProto(t.dtype(), absl::StrCat("spec.layout.tensors[", i, "].dtype"));
    if (!dtype.ok()) return dtype.status();
    if (t.aliases_size() > static_cast<int>(Layout::kMaxAliases)) {
      return absl::InvalidArgumentError(absl::StrCat("spec.layout.tensors[", i, "].aliases: at most ",
                                                     Layout::kMaxAliases, ", got ",
                                                     t.aliases_size()));
    }
    TensorSpec spec;
    spec.name = t.name();
    spec.shape.assign(t.shape().begin(), t.shape().end());
    spec.dtype = *dtype;
    spec.layer = t.layer();
    spec.group = t.group();
    spec.frozen = t.frozen();
    spec.aliases.assign(t.aliases().begin(), t.aliases().end());
    specs.push_back(std::move(spec));
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
    s->set_dtype(WireDType(t.spec.dtype));
    s->set_layer(t.spec.layer);
    s->set_group(t.spec.group);
    s->set_frozen(t.spec.frozen);
    for (const std::string& a : t.spec.aliases) s->add_aliases(a);
  }
  return out;
}

v1::JobSpec ToJobSpec(const JobSettings& s, const Layout& layout) {
  v1::JobSpec spec;
  spec.set_job_id(s.job_id);
  *spec.mutable_layout() = LayoutToProto(layout);
  spec.set_layout_fingerprint(layout.fingerprint());
  spec.set_stage(s.stage);
  spec.set_world_size(s.world_size);
  spec.set_precision(WireDType(s.precision));
  spec.set_reduction(static_cast<v1::ReductionMode>(s.reduction));
  v1::OptimizerConfig* o = spec.mutable_optimizer();
  o->set_kind(static_cast<v1::OptimizerKind>(s.optimizer.kind));
  o->set_lr(s.optimizer.lr);
  o->set_beta1(s.optimizer.beta1);
  o->set_beta2(s.optimizer.beta2);
  o->set_eps(s.optimizer.eps);
  o->set_weight_decay(s.optimizer.weight_decay);
  o->set_momentum(s.optimizer.momentum);
  v1::LossScaleConfig* ls = spec.mutable_loss_scale();
  ls->set_dynamic(s.loss_scale.dynamic);
  ls->set_initial_scale(s.loss_scale.initial_scale);
  if (s.loss_scale.dynamic) {
    ls->set_growth_interval(s.loss_scale.growth_interval);
    ls->set_growth_factor(s.loss_scale.growth_factor);
    ls->set_backoff_factor(s.loss_scale.backoff_factor);
  }
  spec.set_bucket_bytes(s.bucket_bytes);
  for (const std::string& d : s.daemons) spec.add_daemons(d);
  if (s.replicas > 1) spec.set_replicas(s.replicas);
  if (s.node_cache) spec.set_node_cache(true);
  for (const ParamGroupSettings& g : s.param_groups) {
    v1::ParamGroup* out = spec.add_param_groups();
    out->set_lr(g.lr);
    out->set_beta1(g.beta1);
    out->set_beta2(g.beta2);
    out->set_eps(g.eps);
    out->set_weight_decay(g.weight_decay);
  }
  return spec;
}

absl::StatusOr<JobConfig> ParseJobSpec(const v1::JobSpec& spec) {
  JobConfig c;
  c.job_id = spec.job_id();
  c.stage = spec.stage();
  c.world_size = spec.world_size();
  absl::StatusOr<DType> precision = DTypeFromProto(spec.precision(), "spec.precision");
  if (!precision.ok()) return precision.status();
  c.precision = *precision;
  // Out-of-range enum values survive the casts and are refused by the
  // validator with their number.
  c.reduction = static_cast<ReductionMode>(spec.reduction());
  const v1::OptimizerConfig& o = spec.optimizer();
  c.optimizer.kind = static_cast<OptimizerKind>(o.kind());
  c.optimizer.lr = o.lr();
  c.optimizer.beta1 = o.beta1();
  c.optimizer.beta2 = o.beta2();
  c.optimizer.eps = o.eps();
  c.optimizer.weight_decay = o.weight_decay();
  c.optimizer.momentum = o.momentum();
  const v1::LossScaleConfig& ls = spec.loss_scale();
  c.loss_scale.dynamic = ls.dynamic();
  c.loss_scale.initial_scale = ls.initial_scale() == 0 ? 1.0f : ls.initial_scale();
  if (ls.dynamic()) {
    c.loss_scale.growth_interval = ls.growth_interval();
    c.loss_scale.growth_factor = ls.growth_factor();
    c.loss_scale.backoff_factor = ls.backoff_factor();
  }
  c.bucket_bytes = spec.bucket_bytes() == 0 ? kDefaultBucketBytes : spec.bucket_bytes();
  c.daemons.assign(spec.daemons().begin(), spec.daemons().end());
  c.replicas = spec.replicas() == 0 ? 1 : spec.replicas();
  c.node_cache = spec.node_cache();
  if (spec.param_groups_size() > static_cast<int>(Layout::kMaxParamGroups)) {
    return absl::InvalidArgumentError(absl::StrCat("spec.param_groups: at most ",
                                                   Layout::kMaxParamGroups, ", got ",
                                                   spec.param_groups_size()));
  }
  for (const v1::ParamGroup& g : spec.param_groups()) {
    c.param_groups.push_back({g.lr(), g.beta1(), g.beta2(), g.eps(), g.weight_decay()});
  }
  if (spec.reduction() < 0 || spec.reduction() > 255 || spec.optimizer().kind() < 0 ||
      spec.optimizer().kind() > 255) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.reduction / spec.optimizer.kind: unknown enum value (",
                     spec.reduction(), ", ", spec.optimizer().kind(), ")"));
  }
  if (absl::Status s = ValidateJobSettings(c, "spec."); !s.ok()) return s;
  absl::StatusOr<Layout> layout = LayoutFromProto(spec.layout());
  if (!layout.ok()) return layout.status();
  if (spec.layout_fingerprint() != layout->fingerprint()) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.layout_fingerprint: does not match the layout (got ",
                     spec.layout_fingerprint(), ", the layout hashes to ", layout->fingerprint(),
                     "): the trainer and daemon disagree on the layout"));
  }
  if (absl::Status s = ValidateLayoutGroups(c, *layout, "spec."); !s.ok()) return s;
  absl::StatusOr<PartitionMap> map = PartitionMap::Create(
      layout->total_elements(), c.world_size, static_cast<uint32_t>(c.daemons.size()));
  if (!map.ok()) return map.status();
  c.layout = *std::move(layout);
  c.map = *map;
  return c;
}

namespace {

std::string ShapeString(const v1::TensorSpec& t) {
  return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]");
}

// The first tensor where two layouts differ, named: what a person fixes
// when ranks build different models. Empty if the layouts are equal.
std::string DescribeLayoutDifference(const v1::Layout& registered, const v1::Layout& got) {
  // 0 stands for the default.
  auto alignment = [](const v1::Layout& l) -> uint64_t {
    return l.alignment_elements() == 0 ? Layout::kDefaultAlignment : l.alignment_elements();
  };
  if (alignment(registered) != alignment(got)) {
    return absl::StrCat("layout.alignment_elements: registered ", alignment(registered), ", got ",
                        alignment(got));
  }
  const int n = std::min(registered.tensors_size(), got.tensors_size());
  for (int i = 0; i < n; ++i) {
    const v1::TensorSpec& a = registered.tensors(i);
    const v1::TensorSpec& b = got.tensors(i);
    const std::string where = absl::StrCat("layout.tensors[", i, "]");
    if (a.name() != b.name()) {
      return absl::StrCat(where, ": registered '", a.name(), "', got '", b.name(), "'");
    }
    if (!std::equal(a.shape().begin(), a.shape().end(), b.shape().begin(), b.shape().end())) {
      return absl::StrCat(where, " '", a.name(), "': registered shape ", ShapeString(a),
                          ", got shape ", ShapeString(b));
    }
    if (a.dtype() != b.dtype()) {
      return absl::StrCat(where, " '", a.name(), "': registered dtype ", v1::DType_Name(a.dtype()),
                          ", got ", v1::DType_Name(b.dtype()));
    }
    if (a.layer() != b.layer()) {
      return absl::StrCat(where, " '", a.name(), "': registered in layer ", a.layer(),
                          ", got layer ", b.layer());
    }
    if (a.group() != b.group()) {
      return absl::StrCat(where, " '", a.name(), "': registered in parameter group ", a.group(),
                          ", got group ", b.group());
    }
    if (a.frozen() != b.frozen()) {
      return absl::StrCat(where, " '", a.name(), "': registered ",
                          a.frozen() ? "frozen" : "trainable", ", got ",
                          b.frozen() ? "frozen" : "trainable");
    }
    if (!std::equal(a.aliases().begin(), a.aliases().end(), b.aliases().begin(),
                    b.aliases().end())) {
      return absl::StrCat(where, " '", a.name(), "': registered aliases [",
                          absl::StrJoin(a.aliases(), ", "), "], got [",
                          absl::StrJoin(b.aliases(), ", "), "]");
    }
  }
  if (registered.tensors_size() != got.tensors_size()) {
    const v1::TensorSpec& first_extra =
        registered.tensors_size() > n ? registered.tensors(n) : got.tensors(n);
    return absl::StrCat("layout: registered ", registered.tensors_size(), " tensors, got ",
                        got.tensors_size(), " (the first not in both: '", first_extra.name(), "')");
  }
  return "";
}

}  // namespace

std::string DescribeSpecDifference(const v1::JobSpec& registered, const v1::JobSpec& got) {
  auto differ = [](absl::string_view field, auto a, auto b) -> std::string {
    return absl::StrCat(field, ": registered ", a, ", got ", b);
  };
  if (registered.layout_fingerprint() != got.layout_fingerprint()) {
    // Name the tensor when the specs carry their layouts (they differ too).
    std::string tensor = DescribeLayoutDifference(registered.layout(), got.layout());
    if (!tensor.empty()) return tensor;
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
  {
    v1::JobSpec a, b;
    *a.mutable_param_groups() = registered.param_groups();
    *b.mutable_param_groups() = got.param_groups();
    if (!google::protobuf::util::MessageDifferencer::Equals(a, b)) {
      return differ("param_groups", a.ShortDebugString(), b.ShortDebugString());
    }
  }
  if (std::max(registered.replicas(), 1u) != std::max(got.replicas(), 1u)) {
    return differ("replicas", std::max(registered.replicas(), 1u), std::max(got.replicas(), 1u));
  }
  if (registered.node_cache() != got.node_cache()) {
    return differ("node_cache", registered.node_cache() ? "true" : "false",
                  got.node_cache() ? "true" : "false");
  }
  const std::string a = absl::StrJoin(registered.daemons(), ",");
  const std::string b = absl::StrJoin(got.daemons(), ",");
  if (a != b) return differ("daemons", a, b);
  if (!google::protobuf::util::MessageDifferencer::Equals(registered.layout(), got.layout())) {
    return "layout: registered and requested layouts differ";
  }
  return "";
}

uint64_t DaemonModelStateFormulaBytes(const JobConfig& config, FlatRange owned) {
  const uint64_t k = config.optimizer.kind == OptimizerKind::kSgdMomentum ? 8 : 12;
  uint64_t rest = 0;  // per element besides the optimizer state
  if (config.stage >= 2) rest += 4;
  if (config.stage == 3 && config.precision != DType::kFp32) rest += 2;
  uint64_t frozen = 0;
  const auto [first, last] = config.layout.TensorsIn(owned);
  for (size_t i = first; i < last; ++i) {
    const TensorPlacement& t = config.layout.tensors()[i];
    if (t.spec.frozen) frozen += t.range().Intersect(owned).size();
  }
  return (k + rest) * (owned.size() - frozen) + (sizeof(float) + rest) * frozen;
}

}  // namespace zeroshard
