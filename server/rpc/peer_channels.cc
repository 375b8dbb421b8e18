#include "server/rpc/peer_channels.h"

#include "common/channel.h"

namespace zeroshard {

absl::StatusOr<std::shared_ptr<grpc::Channel>> PeerChannels::Get(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(peer);
  if (it != channels_.end()) return it->second;
  absl::StatusOr<ChannelSecurity> security = MakeChannelSecurity(tls_, "", "--tls_");
  if (!security.ok()) return security.status();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(tag_, static_cast<int>(++channels_made_ & 0x7fffffff));
  SetChannelKeepalive(liveness_timeout_, &args);
  std::shared_ptr<grpc::Channel> channel = MakeChannel(peer, *security, args);
  channels_.emplace(peer, channel);
  return channel;
}

void PeerChannels::Drop(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  channels_.erase(peer);
}

}  // namespace zeroshard
