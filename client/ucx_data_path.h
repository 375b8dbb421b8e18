#pragma once

// DataPath over a bulk transport (UCX): gradient bytes are Put into the
// rank's staging region on the daemon and announced by a PushGradient RPC
// whose chunk says where they are (`staged`); parameters are read with Get
// straight from the daemon's parameter regions into the caller's buffer,
// after a Gather RPC with `wait_only` has confirmed the step is committed.
// Initial parameters (and a push larger than a staging slot) use the gRPC
// streams. The control plane stays on gRPC.
//
// Set-up is lazy: the first push or gather for a job exchanges endpoints
// (ExchangeEndpoint RPC) and connects, bounded by that call's deadline. One
// UcxDataPath serves one job.
//
// The staging region has a fixed number of slots (two); a push holds one
// from its Put until the daemon has applied the chunk, so at most that many
// pushes to one daemon are in flight and further ones wait (until their
// deadline) for a slot. Nothing is allocated per push.
//
// Connections: one per progress thread of the transport. The Puts of all
// pushes take the first, so one thread copies gradients while the daemon
// applies the previous slot (spreading them measured slower: the daemon's
// apply needs a core too); the Gets of a gather take each connection in
// turn and copy in parallel.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "client/data_path.h"
#include "client/grpc_data_path.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard/v1/shard.grpc.pb.h"
#include "transport/transport.h"

namespace zeroshard {

class UcxDataPath final : public DataPath {
 public:
  // `channel` is the daemon's channel (shared with the control plane);
  // `transport` is the client's transport, shared by its data paths;
  // `connections` (>= 1): how many UCX connections to open to the daemon,
  // one per progress thread of `transport`.
  UcxDataPath(std::string address, std::shared_ptr<grpc::Channel> channel,
              std::shared_ptr<transport::Transport> transport, int connections);
  // Waits for nothing: every operation has finished when its call returned.
  ~UcxDataPath() override;

  const std::string& address() const override { return fallback_.address(); }
  const char* name() const override { return "ucx"; }

  // Blocks until the daemon applied the chunk. `push.data` is read by the
  // transport only during the call (the Put completes before it returns).
  absl::StatusOr<uint64_t> PushGradient(const GradientPush& push, absl::Time deadline) override;
  absl::StatusOr<uint64_t> InitParameters(const ParameterUpload& upload,
                                          absl::Time deadline) override;
  // Blocks until the step is committed and the bytes are in `dst`. Range and
  // dtype are checked by the daemon (wait_only Gather) before any Get.
  absl::StatusOr<uint64_t> Gather(const GatherRequestSpec& request, void* dst,
                                  absl::Time deadline) override;

 private:
  struct Endpoint {
    std::string job_id;
    // connections[0] carries the Puts; Gets take each in turn.
    std::vector<std::unique_ptr<transport::Connection>> connections;
    mutable std::atomic<size_t> next_get{0};
    transport::RegionDescriptor staging;
    uint64_t slot_bytes = 0;
    transport::RegionDescriptor master;
    FlatRange master_range;
    bool has_half = false;
    transport::RegionDescriptor half;
    FlatRange half_range;
  };

  // The endpoint for `job_id`, exchanging and connecting on first use.
  absl::StatusOr<const Endpoint*> GetEndpoint(const std::string& job_id, uint32_t rank,
                                              absl::Time deadline);
  // Waits (until `deadline`) for a free staging slot and takes it.
  absl::StatusOr<int> AcquireSlot(absl::Time deadline);
  void ReleaseSlot(int slot);
  // Waits for `completion` until `deadline`; past it, aborts the operation
  // and waits until the transport has let go of the buffer (which an aborted
  // operation does promptly; a line on stderr every 10 s while it has not).
  // `what` names the operation in an error (built only then).
  absl::Status Finish(transport::Completion& completion, absl::Time deadline,
                      absl::FunctionRef<std::string()> what);

  std::shared_ptr<transport::Transport> transport_;
  // Serves what UCX does not (initial parameters, oversized pushes) and
  // shares its Shard stub and address.
  GrpcDataPath fallback_;
  const int connections_;

  absl::Mutex setup_mu_;
  std::unique_ptr<Endpoint> endpoint_ ABSL_GUARDED_BY(setup_mu_);
  std::atomic<const Endpoint*> ready_{nullptr};  // endpoint_ once set up

  absl::Mutex slot_mu_;
  std::vector<bool> slot_busy_ ABSL_GUARDED_BY(slot_mu_);
};

}  // namespace zeroshard
