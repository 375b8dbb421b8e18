#include "server/rpc/job_wire.h"

#include <utility>

#include "common/job_spec.h"

namespace zeroshard {
namespace {

FlatRange RangeOf(const v1::FlatRange& r) { return {r.begin(), r.end()}; }

void SetRange(const FlatRange& r, v1::FlatRange* out) {
  out->set_begin(r.begin);
  out->set_end(r.end);
}

}  // namespace

JoinRequest FromWire(const v1::JoinJobRequest& r) {
  JoinRequest out;
  out.rank = r.rank();
  out.incarnation = r.incarnation();
  out.layout_fingerprint = r.layout_fingerprint();
  out.stage = r.stage();
  out.world_size = r.world_size();
  out.precision = r.precision();
  return out;
}

void ToWire(const JoinResult& r, v1::JoinJobResponse* out) {
  if (r.replaced_incarnation != 0) {
    out->set_replaced_incarnation(r.replaced_incarnation);
    out->set_dropped_contributions(r.dropped_contributions);
  }
  out->set_ranks_connected(r.ranks_connected);
  out->set_committed_step(r.committed_step);
}

ParameterChunkIn FromWire(const v1::ParameterChunk& c) {
  ParameterChunkIn out;
  out.range = RangeOf(c.range());
  out.dtype = c.dtype();
  out.data = c.data();
  out.crc32c = c.crc32c();
  return out;
}

GradientChunkIn FromWire(const v1::GradientChunk& c) {
  GradientChunkIn out;
  out.step = c.step();
  out.rank = c.rank();
  out.incarnation = c.incarnation();
  out.range = RangeOf(c.range());
  out.dtype = c.dtype();
  out.crc32c = c.crc32c();
  out.micro_batch = c.micro_batch();
  out.micro_batches = c.micro_batches();
  out.staged = c.staged();
  out.no_grad_tensors = absl::MakeConstSpan(c.no_grad_tensors().data(), c.no_grad_tensors_size());
  out.payload = c.data();
  return out;
}

StateChunkIn FromWire(const v1::StateChunk& c) {
  StateChunkIn out;
  out.rank = c.rank();
  out.incarnation = c.incarnation();
  out.array = c.array();
  out.range = RangeOf(c.range());
  out.data = c.data();
  out.crc32c = c.crc32c();
  out.tensor_steps.reserve(c.tensor_steps_size());
  for (const v1::TensorStep& t : c.tensor_steps()) out.tensor_steps.push_back({t.tensor(), t.steps()});
  return out;
}

CommitRequest FromWire(const v1::CommitStepRequest& r) {
  CommitRequest out;
  out.step = r.step();
  out.clip_coef = r.clip_coef();
  out.skip = r.skip();
  out.lr = r.lr();
  out.grad_norm = r.grad_norm();
  out.rank = r.rank();
  out.incarnation = r.incarnation();
  out.group_lrs.assign(r.group_lrs().begin(), r.group_lrs().end());
  return out;
}

void ToWire(const PushResult& r, v1::PushGradientResponse* out) {
  out->set_elements(r.elements);
  out->set_ranks_complete(r.ranks_complete);
}

void ToWire(const PrepareResult& r, v1::PrepareStepResponse* out) {
  out->set_grad_sq_sum(r.grad_sq_sum);
  out->set_found_inf_nan(r.found_inf_nan);
  out->set_elements(r.elements);
  out->set_loss_scale(r.loss_scale);
  out->set_backup_in_sync(r.backup_in_sync);
}

void ToWire(const CommitResult& r, v1::CommitStepResponse* out) {
  out->set_committed_step(r.committed_step);
  out->set_loss_scale(r.loss_scale);
  out->set_skipped(r.skipped);
}

void ToWire(const WriteStateResult& r, v1::WriteStateResponse* out) {
  out->set_elements(r.elements);
  out->set_tensor_steps(r.tensor_steps);
}

void ToWire(const JobStepState& s, v1::StepState* out) {
  out->set_ranks_joined(s.ranks_joined);
  out->set_ranks_connected(s.ranks_connected);
  for (const RankStatus& r : s.ranks) {
    v1::RankState* o = out->add_ranks();
    o->set_rank(r.rank);
    o->set_joined(r.joined);
    o->set_connected(r.connected);
    o->set_incarnation(r.incarnation);
    o->set_seconds_since_heard(r.seconds_since_heard);
    o->set_last_step_pushed(r.last_step_pushed);
  }
  const StepProgress& p = s.step;
  out->set_world_size(p.world_size);
  out->set_committed_step(p.committed_step);
  out->set_loss_scale(p.loss_scale);
  out->set_last_skipped(p.last_skipped);
  out->set_last_clip_coef(p.last_clip_coef);
  out->set_last_grad_norm(p.last_grad_norm);
  out->set_last_lr(p.last_lr);
  out->set_prepared(p.prepared);
  out->set_complete_elements(p.complete_elements);
  out->set_owned_elements(p.owned_elements);
  for (const MissingRange& m : p.missing) {
    v1::MissingContribution* o = out->add_missing();
    SetRange(m.range, o->mutable_range());
    o->set_rank(m.rank);
    o->set_contributions(m.contributions);
    o->set_expected(m.expected);
  }
}

void ToWire(const ReplicaGroupStatus& s, v1::ReplicaGroupState* out) {
  out->set_group(s.group);
  out->set_peer_address(s.peer_address);
  out->set_role(s.role == ReplicaRole::kPrimary ? v1::REPLICA_ROLE_PRIMARY
                                                : v1::REPLICA_ROLE_BACKUP);
  out->set_epoch(s.epoch);
  out->set_in_sync(s.in_sync);
  out->set_committed_step(s.committed_step);
  out->set_prepared(s.prepared);
}

void ToWire(const std::vector<ParameterRegion>& regions, v1::ExchangeEndpointResponse* out) {
  for (const ParameterRegion& region : regions) {
    v1::RemoteRegion* r = out->add_regions();
    r->set_purpose(region.purpose == ParameterRegion::Purpose::kMaster
                       ? v1::REGION_PURPOSE_PARAM_MASTER
                       : v1::REGION_PURPOSE_PARAM_HALF);
    r->set_address(region.address);
    r->set_length(region.length);
    r->set_rkey(region.rkey);
    SetRange(region.range, r->mutable_range());
  }
}

void ToWire(const CheckpointSaved& r, v1::SaveCheckpointResponse* out) {
  out->set_step(r.step);
  out->set_bytes(r.bytes);
  out->set_snapshot_seconds(r.snapshot_seconds);
}

void ToWire(CheckpointProgress p, v1::CheckpointStatus* out) {
  switch (p.state) {
    case CheckpointProgress::State::kWriting:
      out->set_state(v1::CheckpointStatus::STATE_WRITING);
      break;
    case CheckpointProgress::State::kWritten:
      out->set_state(v1::CheckpointStatus::STATE_WRITTEN);
      break;
    case CheckpointProgress::State::kFailed:
      out->set_state(v1::CheckpointStatus::STATE_FAILED);
      break;
  }
  out->set_name(std::move(p.name));
  out->set_bytes_written(p.bytes_written);
  out->set_bytes_total(p.bytes_total);
  if (p.part.has_value()) *out->mutable_part() = std::move(*p.part);
  if (!p.error.ok()) {
    out->set_error(std::string(p.error.message()));
    out->set_error_code(static_cast<int32_t>(p.error.code()));
  }
}

void ToWire(const CheckpointLoaded& r, v1::LoadCheckpointResponse* out) {
  out->set_name(r.name);
  out->set_step(r.step);
  out->set_bytes_read(r.bytes_read);
  out->set_seconds(r.seconds);
}

void SwapToWire(ParameterChunkOut& c, v1::ParameterChunk* out) {
  out->set_dtype(WireDType(c.dtype));
  out->set_step(c.step);
  SetRange(c.range, out->mutable_range());
  out->set_crc32c(c.crc32c);
  out->mutable_data()->swap(c.data);
}

void SwapBack(v1::ParameterChunk* out, ParameterChunkOut& c) { out->mutable_data()->swap(c.data); }

void SwapToWire(StateChunkOut& c, v1::StateChunk* out) {
  SetRange(c.range, out->mutable_range());
  out->set_crc32c(c.crc32c);
  out->clear_tensor_steps();
  for (const TensorStepCount& t : c.tensor_steps) {
    v1::TensorStep* o = out->add_tensor_steps();
    o->set_tensor(t.tensor);
    o->set_steps(t.steps);
  }
  out->mutable_data()->swap(c.data);
}

void SwapBack(v1::StateChunk* out, StateChunkOut& c) { out->mutable_data()->swap(c.data); }

}  // namespace zeroshard
