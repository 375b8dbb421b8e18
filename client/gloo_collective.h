#pragma once

// The trainer collective on CPUs (REDUCTION_MODE_TRAINER_COLLECTIVE) over
// Gloo's TCP transport; what every trainer collective does, and its
// bookkeeping and errors, are in client/trainer_collective.h. Host buffers
// only. Per rank and step (N_d - 1)/N_d Ψ fp32 elements go out to the other
// ranks and as many come in (TrafficBytes::collective_*); an AllGather sends
// (N_d - 1)/N_d of the range out and receives as much.
//
// Memory, allocated once by Bind: one fp32 buffer of the rank's full
// gradient (Layout::total_elements), a receive buffer of (N_d - 1) exchange
// chunks, and one bucket of the wire dtype for the pushes. Reduce adds
// contributions into the fp32 buffer on the calling thread.
//
// The reduced value of element i is (((g_0 + g_1) + g_2) + ...) in rank
// order, with g_r rank r's micro-batch sum, in fp32: the order in which the
// daemons sum contributions in daemon reduce (server/step/reduction.h), so with
// one micro-batch and an fp32 job both modes deliver the same bits. (The
// squared norm for clipping is summed per pushed chunk, and the modes cut
// chunks differently where a daemon owns several partitions: its double
// may differ in the last bits, and the fp32 norm a step uses only if that
// crosses a float rounding boundary.)
//
// Rendezvous: the first Finish connects the ranks through a
// gloo::rendezvous::FileStore in `Options::rendezvous_dir` under the key
// prefix "zeroshard/<job id>". The directory must be the same one for every
// rank (one host, or a filesystem every node mounts, e.g. NFS: the store
// polls files and needs no inotify). Once connected, a rank removes the
// files it wrote; a rendezvous that failed leaves them, and the next run of
// the same job id in that directory then fails with FailedPrecondition (use
// a fresh directory or remove them). Each rank listens on the TCP transport
// of `Options::hostname` (or `Options::interface`).
//
// Deadlines: every wait (the rendezvous, each chunk of the exchange, each
// push) ends at Finish's deadline or sooner. The rendezvous store is a
// FileStore whose waits (also those inside Gloo's connectFullMesh, which
// would otherwise wait up to Gloo's default of 30 s per key) poll every
// 10 ms until the deadline.
//
// Errors of the exchange (absl::Status; Gloo's exceptions are caught and
// converted), beside those of client/trainer_collective.h:
//   DeadlineExceeded    a rank did not arrive at the rendezvous, or did not
//                       send its part of the exchange or of an AllGather
//                       before the deadline (the message names the ranks
//                       whose arrival or data was missing at the deadline);
//   Unavailable         a peer's connection failed;
//   FailedPrecondition  the rendezvous directory is unusable (Gloo's error
//                       text included), or holds files of an earlier failed
//                       run.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/trainer_collective.h"

namespace gloo {
class Context;
namespace transport {
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo

namespace zeroshard {

class GlooCollective final : public TrainerCollective {
 public:
  struct Options {
    // Shared by every rank of the job (see above). Required.
    std::string rendezvous_dir;
    // The address this rank's TCP transport listens on and tells its peers;
    // used when `interface` is empty.
    std::string hostname = "127.0.0.1";
    // A network interface name (e.g. "eth0") instead of `hostname`.
    std::string interface;
    // fp32 bytes exchanged with each peer per round of the exchange (the
    // receive buffer holds N_d - 1 of them). kMinExchangeChunkBytes..kMaxExchangeChunkBytes;
    // Bind refuses a job whose partitions would take more than 2^24 rounds.
    uint64_t chunk_bytes = 4ull << 20;
  };
  static constexpr uint64_t kMinExchangeChunkBytes = uint64_t{64} << 10;
  static constexpr uint64_t kMaxExchangeChunkBytes = uint64_t{1} << 30;

  // InvalidArgument for a bad option. Connects nothing yet.
  static absl::StatusOr<std::unique_ptr<GlooCollective>> Create(const Options& options);
  ~GlooCollective() override;

  const char* name() const override { return "gloo"; }

 private:
  explicit GlooCollective(const Options& options);

  MemoryKind memory_kind() const override { return MemoryKind::kHost; }
  // InvalidArgument for a job whose partitions take too many exchange rounds.
  absl::Status Allocate(const CollectiveJob& job, const BucketPlan& plan) override;
  uint64_t allocated_bytes() const override;
  absl::Status Accumulate(uint32_t micro_batch, const FlatRange& range, const void* grads,
                          DType dtype, absl::Time deadline) override;
  absl::Status Exchange(absl::Time deadline) override;
  absl::StatusOr<const void*> WireBucket(const FlatRange& bucket, absl::Time deadline) override;
  bool carries_marks() const override { return true; }
  // An all-gather of every rank's marks (a byte per tensor, in marks_),
  // then their minimum.
  absl::Status ExchangeMarks(std::vector<uint8_t>* marks, absl::Time deadline) override;
  absl::Status ExchangeGather(const FlatRange& range, void* dst, DType dtype,
                              absl::Time deadline) override;

  // Rendezvous and connection (the first exchange).
  absl::Status Connect(absl::Time deadline);
  // Rank q's piece of an all-gather: where it lies (in the caller's buffer
  // for every rank), its size (0: none).
  struct Piece {
    uint8_t* data = nullptr;
    uint64_t bytes = 0;
  };
  // Sends this rank's piece to every peer and receives each peer's into its
  // place, connecting first where needed; `what` and `call` name the
  // exchange in errors, which name the peers that sent nothing.
  absl::Status AllGatherPieces(const std::function<Piece(uint32_t)>& piece,
                               const std::string& what, const std::string& call,
                               absl::Time deadline);

  const Options options_;

  // Written once by Allocate; the buffers are used by the hooks under the
  // protocol of TrainerCollective (Accumulate on claimed ranges; the rest
  // one at a time).
  uint64_t chunk_elements_ = 0;         // per peer and round of the exchange
  std::unique_ptr<float[]> acc_;        // total_elements, gaps stay 0
  std::unique_ptr<float[]> recv_;       // (world_size - 1) * chunk_elements_, by peer
  std::unique_ptr<uint8_t[]> staging_;  // one bucket of the wire dtype
  uint64_t staging_size_ = 0;
  std::unique_ptr<uint8_t[]> marks_;    // world_size x tensors, by rank
  uint64_t marks_size_ = 0;

  // Gloo objects: created by Connect, used by the exchanges.
  std::shared_ptr<gloo::Context> context_;
  std::unique_ptr<gloo::transport::UnboundBuffer> send_buffer_;  // over acc_
  // Peer q's chunk of recv_, at index q < rank ? q : q - 1.
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> recv_buffers_;
  // The slot of the next exchange round (not the context's int counter,
  // which would wrap in a long run).
  uint64_t next_slot_ = 0;
};

}  // namespace zeroshard
