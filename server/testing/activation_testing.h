#pragma once

// Test helpers for the Activation service: owners and keys, thin synchronous
// wrappers over its RPCs, and the bad-input check that also covers the
// ledger's every entry and the activation store's state.

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "proto/zeroshard/v1/activation.grpc.pb.h"
#include "server/activation/activation_store.h"
#include "server/activation/activation_store_testing.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard::testing {

v1::ActivationOwner MakeOwner(const std::string& job, uint32_t rank,
                              uint64_t incarnation = kTestIncarnation);
v1::ActivationKey MakeKey(uint64_t step, uint32_t layer, uint32_t micro_batch = 0,
                          uint32_t mp_rank = 0, uint32_t mp_size = 1);

// Activation RPCs over a plaintext channel whose calls carry `token`.
struct ActivationClient {
  explicit ActivationClient(const std::string& address, const std::string& token = kTestToken);
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Activation::Stub> stub;

  grpc::Status Reserve(const v1::ActivationOwner& owner, const v1::ActivationKey& key,
                       uint64_t bytes, v1::ActivationPlacement* placement = nullptr);
  grpc::Status Commit(const v1::ActivationOwner& owner, const v1::ActivationKey& key,
                      std::optional<uint32_t> crc32c, v1::ActivationStored* stored = nullptr);
  grpc::Status Locate(const v1::ActivationOwner& owner, const v1::ActivationKey& key,
                      v1::ActivationPlacement* placement);
  // Sends `bytes` in chunks of `chunk_bytes`, each with its CRC-32C, the
  // first naming the owner, key and size; `edit` may change chunk i before
  // it goes (bad-input tests).
  grpc::Status Offload(const v1::ActivationOwner& owner, const v1::ActivationKey& key,
                       const std::string& bytes, uint64_t chunk_bytes = 256 << 10,
                       const std::function<void(size_t i, v1::ActivationChunk*)>& edit = nullptr,
                       v1::ActivationStored* stored = nullptr);
  // Reads the slice into *out, checking each chunk's offset and CRC-32C.
  grpc::Status Fetch(const v1::ActivationOwner& owner, const v1::ActivationKey& key,
                     std::string* out, uint64_t max_chunk_bytes = 0);
  grpc::Status Prefetch(const v1::ActivationOwner& owner,
                        const std::vector<v1::ActivationKey>& keys, uint32_t* started = nullptr);
  // One key (key set), a step (whole_step), or all of the rank's (neither).
  grpc::Status Free(const v1::ActivationOwner& owner, const v1::ActivationKey* key,
                    bool whole_step = false, v1::FreeActivationsResponse* response = nullptr,
                    std::optional<uint64_t> if_placement = std::nullopt);
};

// ExpectRejected (daemon_fixture.h), and that no entry or category of the
// ledger and nothing in the daemon's activation store changed.
void ExpectActivationRejected(Daemon& daemon, const std::string& job, grpc::StatusCode code,
                              const std::string& text, const std::function<grpc::Status()>& call);

// The value of one sample ("name{labels}") of the daemon's metrics; 0 when
// it is not exported.
double MetricValue(const Daemon& daemon, const std::string& series);

}  // namespace zeroshard::testing
