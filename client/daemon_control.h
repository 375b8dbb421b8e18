#pragma once

// Control-plane calls to one daemon, as blocking calls with a deadline whose
// errors name the daemon (see DaemonError in client/rpc.h). Each call is the
// RPC its proto comment describes, used for nothing else: reads of the step
// state go through GetStepState, never through a mutating call.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard/v1/control.grpc.pb.h"
#include "proto/zeroshard/v1/shard.grpc.pb.h"

namespace zeroshard {

// Who is calling: the job, the rank and the rank's incarnation.
struct RankId {
  std::string job_id;
  uint32_t rank = 0;
  uint64_t incarnation = 0;
};

// What daemon `address` waits for in its open step, from its step state:
// "step 117: daemon node1:7070 waits for rank 3, range [117504, 234944)"
// (one clause per rank, adjacent ranges merged, at most the ranges the
// state reports); empty when it waits for nothing.
std::string DescribeWaits(const std::string& address, const v1::StepState& state);

// Thread-safe; each call blocks its calling thread until done or `deadline`.
class DaemonControl {
 public:
  DaemonControl(std::string address, std::shared_ptr<grpc::Channel> channel);

  const std::string& address() const { return address_; }

  // With `registration_token` (non-empty) sent as kRegistrationMetadataKey.
  absl::StatusOr<v1::RegisterJobResponse> RegisterJob(const v1::JobSpec& spec,
                                                      uint32_t daemon_index, bool as_backup,
                                                      absl::Time deadline,
                                                      const std::string& registration_token = "");
  absl::StatusOr<v1::JoinJobResponse> JoinJob(const v1::JoinJobRequest& request,
                                              absl::Time deadline);
  // Liveness: the daemon records that `id` is alive.
  absl::Status Heartbeat(const RankId& id, absl::Time deadline);
  // Read-only: committed step, last commit's decisions, ranks joined. With
  // wait_for_step > 0 the daemon answers once it has committed that step or
  // after `wait` (a long poll; the RPC's deadline must leave room for it).
  // kBrief leaves out the per-rank list and the missing ranges.
  enum class Detail { kFull, kBrief };
  absl::StatusOr<v1::StepState> GetStepState(const std::string& job_id, absl::Time deadline,
                                             uint64_t wait_for_step = 0,
                                             absl::Duration wait = absl::ZeroDuration(),
                                             Detail detail = Detail::kFull);
  // As the leader `id` (rank 0).
  absl::StatusOr<v1::PrepareStepResponse> PrepareStep(const RankId& id, uint64_t step,
                                                      absl::Time deadline);
  absl::StatusOr<v1::CommitStepResponse> CommitStep(const v1::CommitStepRequest& request,
                                                    absl::Time deadline);
  // Reports `unreported_read_bytes` (LeaveRequest.unreported_read_bytes).
  absl::Status Leave(const RankId& id, absl::Time deadline, uint64_t unreported_read_bytes = 0);
  // Shard.ReadState: passes every chunk of the answer to `take`, in order;
  // an error from `take` cancels the call and is returned.
  absl::Status ReadState(const v1::ReadStateRequest& request, absl::Time deadline,
                         absl::FunctionRef<absl::Status(const v1::StateChunk&)> take);
  // Shard.WriteState with `chunks` as one stream (applied whole or not at
  // all).
  absl::StatusOr<v1::WriteStateResponse> WriteState(const std::vector<v1::StateChunk>& chunks,
                                                    absl::Time deadline);

 private:
  const std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Control::Stub> control_;
  std::unique_ptr<v1::Shard::Stub> shard_;
};

}  // namespace zeroshard
