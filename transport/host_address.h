#pragma once

// The host part of the addresses a transport serves on and hands to peers:
// which hosts are wildcards, the form an advertised host takes, and the
// address other machines most likely reach this one at.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard::transport {

// Whether `host` (the HOST of a HOST:PORT) is a wildcard address, IPv4 or
// IPv6 with or without brackets ("0.0.0.0", "[::]", "::"): a server bound
// there accepts connections on every interface, but no peer can dial it.
bool IsWildcardHost(absl::string_view host);

// `host` in the form it takes before ":PORT": a name or an IPv4 address as
// given, an IPv6 address in brackets (added when missing, as Kubernetes'
// status.podIP gives it). InvalidArgument starting with `field` for anything
// else: empty, a wildcard, a port, characters no host name has.
absl::StatusOr<std::string> CanonicalHost(absl::string_view host, absl::string_view field);

// The address other machines most likely reach this one at, for a server
// bound to a wildcard, numeric (IPv6 in brackets): this machine's name
// (gethostname()) resolved to an address that is not loopback, link-local
// or a wildcard; else the IPv4 address of the interface the default IPv4
// route leaves by (/proc/net/route); else the machine's only non-loopback
// IPv4 address, if it has exactly one. NotFound saying what was tried when
// none of these gives one. Blocks while the name resolves (bounded by the
// resolver's own timeouts).
absl::StatusOr<std::string> PrimaryHostAddress();

// The IPv4 addresses (dotted quads) of this machine's interfaces that are up
// and not loopback, in getifaddrs() order, with each one's interface name.
struct InterfaceAddress {
  std::string interface;
  std::string address;
};
std::vector<InterfaceAddress> NonLoopbackIpv4Addresses();

}  // namespace zeroshard::transport
