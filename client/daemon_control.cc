#include "client/daemon_control.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/rpc.h"
#include "common/auth.h"
#include "common/protocol.h"

namespace zeroshard {

std::string DescribeWaits(const std::string& address, const v1::StepState& state) {
  if (state.missing().empty()) return "";
  // Ranks in the order the daemon reports them, each with its ranges
  // (adjacent ones merged).
  std::vector<std::pair<uint32_t, std::vector<std::pair<uint64_t, uint64_t>>>> by_rank;
  for (const v1::MissingContribution& m : state.missing()) {
    auto it = std::find_if(by_rank.begin(), by_rank.end(),
                           [&](const auto& e) { return e.first == m.rank(); });
    if (it == by_rank.end()) it = by_rank.insert(by_rank.end(), {m.rank(), {}});
    auto& ranges = it->second;
    if (!ranges.empty() && ranges.back().second == m.range().begin()) {
      ranges.back().second = m.range().end();
    } else {
      ranges.emplace_back(m.range().begin(), m.range().end());
    }
  }
  std::string out = absl::StrCat("step ", state.committed_step() + 1, ": daemon ", address);
  for (size_t i = 0; i < by_rank.size(); ++i) {
    absl::StrAppend(&out, i == 0 ? " waits for rank " : "; and for rank ", by_rank[i].first,
                    by_rank[i].second.size() == 1 ? ", range " : ", ranges ");
    for (size_t j = 0; j < by_rank[i].second.size(); ++j) {
      absl::StrAppend(&out, j == 0 ? "" : ", ", "[", by_rank[i].second[j].first, ", ",
                      by_rank[i].second[j].second, ")");
    }
  }
  return out;
}

DaemonControl::DaemonControl(std::string address, std::shared_ptr<grpc::Channel> channel)
    : address_(std::move(address)),
      channel_(std::move(channel)),
      control_(v1::Control::NewStub(channel_)),
      shard_(v1::Shard::NewStub(channel_)) {}

absl::StatusOr<v1::RegisterJobResponse> DaemonControl::RegisterJob(const v1::JobSpec& spec,
                                                                   uint32_t daemon_index,
                                                                   bool as_backup,
                                                                   absl::Time deadline,
                                                                   const std::string& registration_token) {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  if (!registration_token.empty()) context.AddMetadata(kRegistrationMetadataKey, registration_token);
  v1::RegisterJobRequest request;
  *request.mutable_spec() = spec;
  request.set_daemon_index(daemon_index);
  request.set_as_backup(as_backup);
  v1::RegisterJobResponse response;
  const grpc::Status s = control_->RegisterJob(&context, request, &response);
  if (!s.ok()) return DaemonError(s, address_, absl::StrCat("RegisterJob ", spec.job_id()));
  return response;
}

absl::StatusOr<v1::JoinJobResponse> DaemonControl::JoinJob(const v1::JoinJobRequest& request,
                                                           absl::Time deadline) {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::JoinJobResponse response;
  const grpc::Status s = control_->JoinJob(&context, request, &response);
  if (!s.ok()) {
    return DaemonError(s, address_,
                       absl::StrCat("JoinJob ", request.job_id(), " rank ", request.rank()));
  }
  return response;
}

absl::Status DaemonControl::Heartbeat(const RankId& id, absl::Time deadline) {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::HeartbeatRequest request;
  request.set_job_id(id.job_id);
  request.set_rank(id.rank);
  request.set_incarnation(id.incarnation);
  v1::HeartbeatResponse response;
  return DaemonError(control_->Heartbeat(&context, request, &response), address_, "Heartbeat");
}

absl::StatusOr<v1::StepState> DaemonControl::GetStepState(const std::string& job_id,
                                                          absl::Time deadline,
                                                          uint64_t wait_for_step,
                                                          absl::Duration wait, Detail detail) {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::GetStepStateRequest request;
  request.set_job_id(job_id);
  request.set_brief(detail == Detail::kBrief);
  if (wait_for_step > 0 && wait > absl::ZeroDuration()) {
    request.set_wait_for_step(wait_for_step);
    request.set_wait_ms(
        static_cast<uint32_t>(std::min<int64_t>(absl::ToInt64Milliseconds(wait), kMaxWaitMs)));
  }
  v1::StepState response;
  const grpc::Status s = shard_->GetStepState(&context, request, &response);
  if (!s.ok()) return DaemonError(s, address_, absl::StrCat("GetStepState ", job_id));
  return response;
}

absl::StatusOr<v1::PrepareStepResponse> DaemonControl::PrepareStep(const RankId& id,
                                                                   uint64_t step,
                                                                   absl::Time deadline) {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::PrepareStepRequest request;
  request.set_job_id(id.job_id);
  request.set_step(step);
  request.set_rank(id.rank);
  request.set_incarnation(id.incarnation);
  v1::PrepareStepResponse response;
  const grpc::Status s = shard_->PrepareStep(&context, request, &response);
  if (!s.ok()) return DaemonError(s, address_, absl::StrCat("PrepareStep ", step));
  return response;
}

absl::StatusOr<v1::CommitStepResponse> DaemonControl::CommitStep(
    const v1::CommitStepRequest& request, absl::Time deadline) {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::CommitStepResponse response;
  const grpc::Status s = shard_->CommitStep(&context, request, &response);
  if (!s.ok()) return DaemonError(s, address_, absl::StrCat("CommitStep ", request.step()));
  return response;
}

absl::Status DaemonControl::Leave(const RankId& id, absl::Time deadline,
                                  uint64_t unreported_read_bytes) {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::LeaveRequest request;
  request.set_job_id(id.job_id);
  request.set_rank(id.rank);
  request.set_incarnation(id.incarnation);
  request.set_unreported_read_bytes(unreported_read_bytes);
  v1::LeaveResponse response;
  return DaemonError(control_->Leave(&context, request, &response), address_, "Leave");
}

absl::Status DaemonControl::ReadState(
    const v1::ReadStateRequest& request, absl::Time deadline,
    absl::FunctionRef<absl::Status(const v1::StateChunk&)> take) {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  std::unique_ptr<grpc::ClientReader<v1::StateChunk>> reader =
      shard_->ReadState(&context, request);
  v1::StateChunk chunk;
  absl::Status taken;
  while (taken.ok() && reader->Read(&chunk)) taken = take(chunk);
  if (!taken.ok()) {
    context.TryCancel();
    (void)reader->Finish();  // cancelled: its status says only that
    return taken;
  }
  return DaemonError(reader->Finish(), address_, "ReadState");
}

absl::StatusOr<v1::WriteStateResponse> DaemonControl::WriteState(
    const std::vector<v1::StateChunk>& chunks, absl::Time deadline) {
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::WriteStateResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::StateChunk>> writer =
      shard_->WriteState(&context, &response);
  for (const v1::StateChunk& c : chunks) {
    if (!writer->Write(c)) break;  // the daemon ended the stream: Finish says why
  }
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  if (!s.ok()) return DaemonError(s, address_, "WriteState");
  return response;
}

}  // namespace zeroshard
