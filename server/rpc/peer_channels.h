#pragma once

// Channels from this daemon to its peer daemons, one per address, opened on
// first use and kept, with the daemon's own TLS files as the client side of
// mutual TLS. Used by the replica link and the node cache's fetches.
// Thread-safe; Get blocks on nothing but reading the TLS files once.

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/keepalive.h"
#include "common/tls.h"
#include "grpcpp/grpcpp.h"

namespace zeroshard {

class PeerChannels {
 public:
  // Reads no file yet: the credentials are made on the first Get, and a
  // failure to make them is every Get's error. `tag` names the channel
  // argument that numbers the channels made (e.g. "zeroshard.replica_link_channel").
  // A peer silent for `liveness_timeout` fails every call in flight on its
  // channel with UNAVAILABLE (common/keepalive.h; zero: no keepalive).
  PeerChannels(TlsFiles tls, std::string tag,
               absl::Duration liveness_timeout = kDefaultLivenessTimeout)
      : tls_(std::move(tls)), tag_(std::move(tag)), liveness_timeout_(liveness_timeout) {}

  // The peer's channel: no message size limit, reconnect backoff 100 ms ..
  // 1 s (a peer that restarts is found again within a second).
  absl::StatusOr<std::shared_ptr<grpc::Channel>> Get(const std::string& peer);
  // Forgets the peer's channel (after UNAVAILABLE), so that the next Get
  // dials afresh instead of waiting out the old channel's reconnect backoff.
  void Drop(const std::string& peer);

 private:
  const TlsFiles tls_;
  const std::string tag_;
  const absl::Duration liveness_timeout_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  // Channels made so far: each gets its number as a channel argument, so
  // that gRPC does not hand a new channel the old one's subchannel.
  int64_t channels_made_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace zeroshard
