#pragma once

// Which of a job's daemons runs on this machine, for the node cache
// (JobSettings::node_cache): a rank sends its gathers of other daemons'
// ranges to its host's daemon.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

// The host of a "HOST:PORT" address (IPv6 without its brackets);
// "localhost" for a unix socket ("unix:PATH").
std::string HostOfAddress(absl::string_view address);

// The index of the first of `daemons` ("HOST:PORT") whose host is an
// address of this machine: one of its interfaces' (getifaddrs) or a
// loopback address; a name is resolved first (getaddrinfo, which may ask
// DNS). -1 when none is. Unavailable when the interfaces cannot be listed.
absl::StatusOr<int> FindLocalDaemon(const std::vector<std::string>& daemons);

}  // namespace zeroshard
