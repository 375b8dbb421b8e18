#pragma once

// Sequences of daemon RPCs as bytes, for //server:daemon_request_fuzzer and
// its seeds, and the in-process daemon they run against.
//
// A sequence is calls back to back, at most kMaxCalls; bytes past the last
// whole call header are ignored, a message cut short by the end is sent as
// far as it goes. One call:
//
//   u8  rpc       index into the table of Rpc below, modulo kNumRpcs
//   u8  fixups    the Fixup bits
//   u8  count     client-streaming RPCs only: messages, modulo
//                 kMaxStreamMessages + 1 (0: an empty stream)
//   per message:  u16 length (little endian), then that many bytes of the
//                 request message (protobuf wire format)
//
// Every method of Control, Shard, Admin, Checkpoint, Activation and Replica
// is in the table but Control.Drain, which would stop the daemon taking jobs
// for the rest of the run. A message that does not parse is not sent.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard/v1/activation.grpc.pb.h"
#include "proto/zeroshard/v1/checkpoint.pb.h"
#include "proto/zeroshard/v1/common.pb.h"
#include "proto/zeroshard/v1/replica.grpc.pb.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"
#include "transport/shm/push_memory.h"
#include "transport/transport.h"

namespace zeroshard::testing {

enum class Rpc : uint8_t {
  kRegisterJob,
  kJoinJob,
  kGetPartitionMap,
  kHeartbeat,
  kLeave,
  kInitParameters,  // client stream
  kPushGradient,    // client stream
  kGather,          // server stream
  kPrepareStep,
  kCommitStep,
  kGetStepState,
  kExchangeEndpoint,
  kFenceStagingSlot,
  kMemoryReport,
  kStatus,
  kEstimate,
  kSaveCheckpoint,
  kGetCheckpointStatus,
  kCompleteCheckpoint,
  kLoadCheckpoint,
  kListCheckpoints,
  kVerifyCheckpoint,
  kReserveActivation,
  kCommitActivation,
  kOffloadActivation,  // client stream
  kLocateActivation,
  kFetchActivation,  // server stream
  kPrefetchActivations,
  kFreeActivations,
  // Added after the others, so that inputs saved before them still decode
  // to the same calls.
  kReadState,   // server stream
  kWriteState,  // client stream
  // The Replica service, driving the replicated job's backup copy (see
  // kReplicaJobId).
  kGetReplicaState,
  kPromote,
  kTransferState,    // client stream
  kForwardGradient,  // client stream
  kCommitReplica,
  kReleaseReplica,
  kMapPushMemory,
};
inline constexpr int kNumRpcs = 38;

// "Service.Method".
const char* RpcName(Rpc rpc);
bool IsClientStreaming(Rpc rpc);

// Edits made to a call's messages before they are sent, so that mutated
// inputs get past checks a fuzzer cannot satisfy by chance. For the Replica
// RPCs the bits aim at the replicated job's backup copy instead (see each).
enum Fixup : uint8_t {
  // Every job id (also a spec's and an activation owner's) is the live job's.
  // Replica RPCs: the replicated job's (kReplicaJobId), also a
  // CommitReplica's commit's.
  kLiveJob = 1 << 0,
  // Ranks are taken modulo the live job's world size (CommitStep: rank 0, the
  // leader) and incarnations are the live ranks' (kTestIncarnation), also in
  // a ReadState and in every chunk of a WriteState; a JoinJob also gets the
  // live job's fingerprint, stage, world size and precision.
  // Replica RPCs: the group is kReplicaBackupGroup and the epoch that copy's
  // (Promote: one above it), in every chunk of a stream. A MapPushMemory
  // names the world's push memory (its pid, fd and name; the bytes as
  // given); a chunk naming a push memory names the id the last
  // MapPushMemory answered.
  kLiveRank = 1 << 1,
  // CRC-32C fields of chunks are recomputed over their data, a
  // CommitActivation's is that of the bytes last put (see kFitData); a
  // RegisterJob spec's layout fingerprint is recomputed from its layout.
  kChecksums = 1 << 2,
  // A chunk's data is tiled (from its bytes, or zeros) to the length its
  // range (activations: up to the next chunk's offset, or total_bytes) calls
  // for, up to kMaxFittedBytes: small inputs carry whole gradients. A
  // WriteState chunk (fp32) then has zeros where the live layout's alignment
  // gaps are (and, for moments, its frozen tensors), as the daemon requires.
  // After a ReserveActivation that succeeds, the placement is filled with a
  // pattern through the bulk transport, as a trainer puts its slice.
  // TransferState chunks (but a bulk one) continue their array from where
  // the stream's earlier chunks left it, the last chunk of each array
  // filling it to the backup copy's owned range; ForwardGradient chunks
  // cover that range back to back, the last one to its end.
  kFitData = 1 << 3,
  // CompleteCheckpoint's parts are the part of the last WRITTEN
  // GetCheckpointStatus answer of the sequence (when there is one).
  kLastPart = 1 << 4,
  // Step fields follow the live job: steps to push, prepare and commit are
  // its committed step + 1; after_step and a save's step are the committed
  // step. Replica RPCs follow the backup copy's committed step the same
  // way (ForwardGradient's step and CommitReplica's commit.step: + 1;
  // Promote's committed_step and a transfer's state.committed_step: as is).
  kLiveStep = 1 << 5,
};
inline constexpr size_t kMaxFittedBytes = 1 << 20;

// With RequestWorld's call deadline, an input that waits in every call
// still ends well inside tools/fuzz.sh's 10 s per-input timeout.
inline constexpr size_t kMaxCalls = 24;
inline constexpr size_t kMaxStreamMessages = 4;

struct Call {
  Rpc rpc = Rpc::kStatus;
  uint8_t fixups = 0;
  // Serialized request messages: exactly one unless the RPC streams from
  // the client.
  std::vector<std::string> messages;
};

std::vector<Call> DecodeSequence(absl::string_view bytes);
// Messages longer than 65535 bytes, or more messages than the format
// carries, are cut.
std::string EncodeSequence(const std::vector<Call>& calls);

// Named seeds for the fuzzer: valid sequences against the live job (one
// training step, checkpoints, activations, state reads and writes, a second
// job with parameter groups, ranks leaving) and a few refused requests.
std::vector<std::pair<std::string, std::vector<Call>>> SeedSequences();

// The live job every world serves, registered by RequestWorld.
inline constexpr char kLiveJobId[] = "fuzz-live";
inline constexpr uint32_t kLiveWorldSize = 2;
inline constexpr uint32_t kLiveStage = 3;
// The live job's spec (SampleLayout) for a daemon at `address`.
v1::JobSpec LiveJobSpec(const std::string& address);

// A second job every world serves, replicated (JobSpec.replicas = 2) over
// the world's daemon (index 0) and kReplicaPeerAddress, where nothing
// listens: the daemon holds group 0 as its primary and group 1
// (kReplicaBackupGroup) as its backup, at epoch 1 and not yet in sync; the
// Replica RPCs drive that copy as group 1's primary would. No rank joins it
// (the world's daemon has no join timeout) and nothing drives group 0: its
// calls need the replica metadata, which the world's calls do not carry.
inline constexpr char kReplicaJobId[] = "fuzz-replica";
inline constexpr char kReplicaPeerAddress[] = "127.0.0.1:1";
inline constexpr uint32_t kReplicaBackupGroup = 1;
v1::JobSpec ReplicaJobSpec(const std::string& address);

// An in-process daemon on loopback (inproc bulk transport, an activation
// arena, spill files and checkpoints in a temporary directory removed on
// destruction) and the live job on it: registered, every rank joined as
// kTestIncarnation, parameters initialised; and the replicated job
// (kReplicaJobId), registered. Calls go through a DaemonClient
// (its channel, and so the credentials it carries). Not thread-safe.
class RequestWorld {
 public:
  struct Options {
    uint64_t memory_limit_bytes = 256ull << 20;
    uint64_t activation_arena_bytes = 4ull << 20;
    uint64_t spill_bytes = 16ull << 20;
    // Deadline of each call of a sequence: waits inside the daemon end then.
    absl::Duration call_deadline = absl::Milliseconds(200);
    // Valid wait_ms fields are reduced modulo this (kMaxWaitMs and beyond
    // are kept, to be refused).
    uint32_t max_wait_ms = 100;
  };

  static absl::StatusOr<std::unique_ptr<RequestWorld>> Create(const Options& options);
  ~RequestWorld();

  // Sends one call (a fixed-up copy of its messages) and waits for its
  // answer; the status of a message that does not parse is
  // INVALID_ARGUMENT from here, without a call.
  grpc::Status Run(const Call& call);

  // What must hold whatever the calls were: the daemon answers Admin.Status
  // and is not draining, and its ledger stays within the memory limit.
  absl::Status CheckInvariants();

  // Puts the daemon back to where Create left it when a sequence changed
  // anything (other jobs, the live job's state, the ledger, files in the
  // checkpoint directory, the replicated job's copies): removes every job,
  // waits until the ledger holds only what it held before the live job was
  // registered (Internal naming the difference if it does not within
  // `settle`: a leak), empties the checkpoint directory and registers the
  // live job and the replicated job again.
  absl::Status Restore(absl::Duration settle = absl::Seconds(2));

  Daemon& daemon() { return *daemon_; }
  DaemonClient& client() { return *client_; }
  uint64_t memory_limit() const { return options_.memory_limit_bytes; }
  // The temporary directory (checkpoints/, spill/).
  const std::string& directory() const { return dir_; }

 private:
  RequestWorld(const Options& options, std::string dir);
  absl::Status StartLiveJob();
  // ReserveActivation, and the put after it (kFitData).
  grpc::Status RunReserve(grpc::ClientContext* ctx, v1::ReserveActivationRequest request, bool put);
  bool Changed();
  // Which copies of the replicated job there are, and their state.
  std::string ReplicaSnapshot();

  const Options options_;
  const std::string dir_;  // checkpoints/ and spill/ under it
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<DaemonClient> client_;
  std::unique_ptr<v1::Activation::Stub> activation_;
  std::unique_ptr<v1::Replica::Stub> replica_;
  uint64_t empty_ledger_bytes_ = 0;  // with no job registered
  // The live job as registered, and what it held then.
  std::shared_ptr<Job> live_;
  uint64_t live_hash_ = 0;
  uint64_t live_ledger_bytes_ = 0;  // with the replicated job too
  std::string replica_snapshot_;     // as registered
  // The part of the last WRITTEN checkpoint status since Restore.
  std::unique_ptr<v1::PartManifest> last_part_;
  // A trainer's end of the bulk transport, for the puts after
  // ReserveActivation (kFitData), and the CRC-32C of the last put.
  std::unique_ptr<transport::Transport> peer_;
  std::unique_ptr<transport::Connection> arena_connection_;
  // A trainer's push memory, for MapPushMemory (kLiveRank), and the id the
  // last MapPushMemory answered since Restore, which pulled chunks name.
  std::unique_ptr<transport::PushMemory> push_memory_;
  uint32_t push_memory_id_ = 0;
  transport::RegionDescriptor arena_;
  uint32_t last_put_crc_ = 0;
};

}  // namespace zeroshard::testing
