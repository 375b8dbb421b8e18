#pragma once

// A stand-in daemon for data-path tests: a gRPC Shard service that serves
// what BulkDataPath uses (ExchangeEndpoint, staged PushGradient,
// FenceStagingSlot, wait_only Gather) over an "inproc" transport, following
// the proto comments for staging slots, and with knobs a real daemon does not
// have: a staged push can be held before or while it reads its slot (a
// daemon waiting for the job lock, or one slow to copy), fences can fail, and
// pushes can be answered with a chosen status. It records what it applied,
// with the bytes it read, and the order of events.
//
// It also serves the Activation service (client/testing/fake_activation.h),
// with an ACTIVATION_ARENA region in ExchangeEndpoint's answer when
// Options::activation_arena_bytes > 0.
//
// Thread-safe. Only one job, rank and incarnation is served (any name).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/testing/fake_activation.h"
#include "common/flat_range.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard/v1/shard.grpc.pb.h"
#include "transport/shm/push_memory.h"
#include "transport/transport.h"

namespace zeroshard::testing {

class FakeShard final : public v1::Shard::Service {
 public:
  struct Options {
    uint32_t staging_slots = 2;
    uint64_t staging_slot_bytes = 4096;
    uint64_t master_elements = 1024;  // PARAM_MASTER holds element i = i * 0.5f
    uint64_t activation_arena_bytes = 0;  // 0: no arena region (activations streamed)
    uint64_t activation_spill_bytes = 64ull << 20;
    uint32_t read_lease_ms = 0;  // ExchangeEndpoint's answer (0: none sent)
    // MapPushMemory maps the trainer's memory (this process's: the fake
    // runs in the test) and answers id 1; staged chunks naming it are read
    // from there. Without it, every MapPushMemory is refused.
    bool map_push_memory = false;
  };
  // Starts serving on 127.0.0.1:0.
  static absl::StatusOr<std::unique_ptr<FakeShard>> Start(const Options& options);
  ~FakeShard() override;

  const std::string& address() const { return address_; }
  FakeActivation& activation() { return *activation_; }

  // A staged push waits this long before it starts reading its slot (a
  // fence that arrives meanwhile wins: the push is then refused).
  void set_delay_before_read(absl::Duration d);
  // A staged push waits this long while it reads its slot (a fence waits
  // for it, then sees it applied).
  void set_delay_while_reading(absl::Duration d);
  // The next `n` FenceStagingSlot calls fail with UNAVAILABLE.
  void fail_fences(int n);
  // Every staged push is answered with `status` instead of applying (OK:
  // apply normally).
  void set_push_status(grpc::Status status);

  struct Applied {
    uint32_t slot;
    uint64_t generation;
    FlatRange range;
    std::string bytes;  // as read from the slot (or push memory) when applied
  };
  std::vector<Applied> applied() const;
  // "announce S G", "apply S G", "refuse S G", "fence S G -> A", in order.
  std::vector<std::string> events() const;
  int exchanges() const;
  // MapPushMemory calls (without Options::map_push_memory each answered
  // FAILED_PRECONDITION, as by a daemon that cannot map the trainer's
  // memory).
  int push_memory_maps() const;
  // Each wait_only Gather answered OK, in order.
  struct WaitOnly {
    uint64_t after_step = 0;
    uint64_t unreported_read_bytes = 0;
  };
  std::vector<WaitOnly> wait_only_gathers() const;

  // Blocks until no staged push is being handled (or 10 s).
  void WaitIdle() const;

  grpc::Status MapPushMemory(grpc::ServerContext* context, const v1::MapPushMemoryRequest* request,
                             v1::MapPushMemoryResponse* response) override;
  grpc::Status ExchangeEndpoint(grpc::ServerContext* context,
                                const v1::ExchangeEndpointRequest* request,
                                v1::ExchangeEndpointResponse* response) override;
  grpc::Status PushGradient(grpc::ServerContext* context,
                            grpc::ServerReader<v1::GradientChunk>* reader,
                            v1::PushGradientResponse* response) override;
  grpc::Status FenceStagingSlot(grpc::ServerContext* context,
                                const v1::FenceStagingSlotRequest* request,
                                v1::FenceStagingSlotResponse* response) override;
  grpc::Status Gather(grpc::ServerContext* context, const v1::GatherRequest* request,
                      grpc::ServerWriter<v1::ParameterChunk>* writer) override;

 private:
  struct SlotState {
    uint64_t applied = 0;  // newest generation applied
    uint64_t fenced = 0;   // every generation <= this is refused
    bool reading = false;
  };

  explicit FakeShard(const Options& options) : options_(options) {}
  // Applies (or refuses) a staged chunk; the caller holds no lock.
  // The chunks of one staged push: one slot, payloads back to back.
  grpc::Status ApplyStaged(const std::vector<v1::GradientChunk>& chunks);

  const Options options_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<transport::Region> staging_;
  std::unique_ptr<transport::Region> master_;
  std::unique_ptr<transport::Region> arena_;          // null without an arena
  std::unique_ptr<FakeActivation> activation_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;

  mutable absl::Mutex mu_;
  std::vector<SlotState> slots_ ABSL_GUARDED_BY(mu_);
  absl::Duration delay_before_read_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  absl::Duration delay_while_reading_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  int fail_fences_ ABSL_GUARDED_BY(mu_) = 0;
  grpc::Status push_status_ ABSL_GUARDED_BY(mu_);
  int pushes_running_ ABSL_GUARDED_BY(mu_) = 0;
  int exchanges_ ABSL_GUARDED_BY(mu_) = 0;
  int push_memory_maps_ ABSL_GUARDED_BY(mu_) = 0;
  // The memory MapPushMemory mapped last (Options::map_push_memory), id 1.
  std::shared_ptr<const transport::PeerMemory> push_memory_ ABSL_GUARDED_BY(mu_);
  std::vector<WaitOnly> wait_only_gathers_ ABSL_GUARDED_BY(mu_);
  std::vector<Applied> applied_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard::testing
