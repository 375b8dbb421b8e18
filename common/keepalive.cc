#include "common/keepalive.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"

namespace zeroshard {

absl::Status ValidateLivenessTimeout(absl::Duration timeout, absl::string_view flag) {
  if (timeout == absl::ZeroDuration() ||
      (timeout >= kMinLivenessTimeout && timeout <= absl::Hours(1))) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(flag, ": must be 0 (off) or between ", absl::FormatDuration(kMinLivenessTimeout),
                   " and 1h, got ", absl::FormatDuration(timeout)));
}

void SetChannelKeepalive(absl::Duration timeout, grpc::ChannelArguments* args) {
  if (timeout <= absl::ZeroDuration()) return;
  const int half_ms = static_cast<int>(
      std::max(absl::ToInt64Milliseconds(timeout / 2), absl::ToInt64Milliseconds(kMinKeepaliveInterval)));
  args->SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, half_ms);
  args->SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, half_ms);
  // Only while calls are in flight: then a thread of this process polls
  // the connection (a waiting call's), and a ping's answer is read at
  // once. On an idle channel of a process with no gRPC server nothing may
  // read it for seconds (gRPC's backup poller), and the watchdog would
  // close a healthy connection.
  args->SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
  // By default a client stops pinging after two pings with no data frame
  // sent between them, and then sends one at most every 5 minutes: a call
  // that only receives (a Gather's stream) would never find its peer
  // silent.
  args->SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args->SetInt(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS, half_ms);
}

void SetServerKeepalivePolicy(grpc::ServerBuilder* builder) {
  // Half the clients' least interval: a ping a timer sends a little early
  // is no strike.
  const int min_ms = static_cast<int>(absl::ToInt64Milliseconds(kMinKeepaliveInterval / 2));
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, min_ms);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // The server's own pings to a quiet client (the default is two hours):
  // a vanished client's connection is closed, and its calls cancelled,
  // within a minute.
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 30 * 1000);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20 * 1000);
}

}  // namespace zeroshard
