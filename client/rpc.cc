#include "client/rpc.h"

#include "absl/strings/str_cat.h"

namespace zeroshard {

std::shared_ptr<grpc::Channel> MakeDaemonChannel(const std::string& address,
                                                 const ChannelSecurity& security,
                                                 std::optional<ReplicaTarget> target,
                                                 absl::Duration liveness_timeout) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
  args.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
  // Each client gets its own connections, so that ranks in one process (tests)
  // behave like ranks in separate processes.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Reconnect quickly after a daemon restarts.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  // A daemon that stops answering (hung, stopped, cut off) fails the calls
  // in flight to it within the liveness timeout, whatever their deadlines:
  // the client's failover starts then, not at the call timeout.
  SetChannelKeepalive(liveness_timeout, &args);
  return MakeChannel(address, security, args, target);
}

void SetDeadline(grpc::ClientContext* context, absl::Time deadline) {
  context->set_deadline(absl::ToChronoTime(deadline));
}

absl::Status DaemonError(const grpc::Status& status, absl::string_view address,
                         absl::string_view what) {
  if (status.ok()) return absl::OkStatus();
  const std::string message =
      absl::StrCat("daemon ", address, ": ", what, ": ", status.error_message());
  switch (status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::CANCELLED:
      return absl::UnavailableError(message);
    default:
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()), message);
  }
}

}  // namespace zeroshard
