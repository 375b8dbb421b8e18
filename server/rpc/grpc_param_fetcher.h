#pragma once

// The node cache's reads from the daemons that own the parameters
// (server/cache/param_cache.h), over the Shard service's Gather, with the
// daemon's own TLS files as the client side of mutual TLS and the bearer
// token of the gather being served. One channel per peer address, opened on
// first use and kept (PeerChannels, one per daemon); a
// GrpcParamFetcher is made per served request.

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/job_spec.h"
#include "common/tls.h"
#include "grpcpp/grpcpp.h"
#include "server/cache/param_cache.h"
#include "server/rpc/peer_channels.h"

namespace zeroshard {

class GrpcParamFetcher final : public ParamFetcher {
 public:
  // `config` (the job's) and `channels` outlive the fetcher; `token` is the
  // bearer token of the request being served.
  GrpcParamFetcher(PeerChannels* channels, const JobConfig* config, std::string token)
      : channels_(channels), config_(config), token_(std::move(token)) {}

  // One Gather stream to config.daemons[owner]; every chunk is checked
  // (CRC-32C, dtype, ranges in order covering `range`, one step) before its
  // bytes count: DataLoss naming the owner otherwise. The owner's codes
  // pass through, named with its address. Thread-safe: the node cache
  // calls it for every owner at once.
  absl::StatusOr<uint64_t> Fetch(uint32_t owner, const FlatRange& range, DType dtype,
                                 uint64_t after_step, absl::Time deadline, void* dst) override;

 private:
  PeerChannels* const channels_;
  const JobConfig* const config_;
  const std::string token_;
};

}  // namespace zeroshard
