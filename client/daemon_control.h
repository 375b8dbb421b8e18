#pragma once

// Control-plane calls to one daemon, as blocking calls with a deadline whose
// errors name the daemon (see DaemonError in client/rpc.h).

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard/v1/admin.grpc.pb.h"
#include "proto/zeroshard/v1/control.grpc.pb.h"
#include "proto/zeroshard/v1/shard.grpc.pb.h"

namespace zeroshard {

// Thread-safe; each call blocks its calling thread until done or `deadline`.
class DaemonControl {
 public:
  DaemonControl(std::string address, std::shared_ptr<grpc::Channel> channel);

  const std::string& address() const { return address_; }

  absl::StatusOr<v1::RegisterJobResponse> RegisterJob(const v1::JobSpec& spec,
                                                      uint32_t daemon_index, absl::Time deadline);
  absl::StatusOr<v1::JoinJobResponse> JoinJob(const v1::JoinJobRequest& request,
                                              absl::Time deadline);
  // The job's entry in the daemon's Status; NotFound if the daemon has none.
  absl::StatusOr<v1::JobStatus> JobStatus(const std::string& job_id, absl::Time deadline);
  absl::StatusOr<uint64_t> Heartbeat(const std::string& job_id, uint32_t rank,
                                     absl::Time deadline);
  absl::StatusOr<v1::PrepareStepResponse> PrepareStep(const std::string& job_id, uint64_t step,
                                                      absl::Time deadline);
  absl::StatusOr<v1::CommitStepResponse> CommitStep(const v1::CommitStepRequest& request,
                                                    absl::Time deadline);
  absl::Status Leave(const std::string& job_id, uint32_t rank, absl::Time deadline);

 private:
  const std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Control::Stub> control_;
  std::unique_ptr<v1::Shard::Stub> shard_;
  std::unique_ptr<v1::Admin::Stub> admin_;
};

}  // namespace zeroshard
