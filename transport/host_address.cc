#include "transport/host_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace zeroshard::transport {
namespace {

// The longest DNS name.
constexpr size_t kMaxHostBytes = 253;

// `host` without the brackets of an IPv6 literal.
absl::string_view Unbracketed(absl::string_view host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    return host.substr(1, host.size() - 2);
  }
  return host;
}

bool IsLoopback(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    return (ntohl(in->sin_addr.s_addr) >> 24) == 127;
  }
  if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    return IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr) != 0 ||
           (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr) != 0 && in6->sin6_addr.s6_addr[12] == 127);
  }
  return false;
}

// Numeric form of an address a peer on another machine could dial: IPv4 or
// bracketed IPv6; empty for loopback, wildcard, link-local (it would need a
// zone) and other families.
std::string Dialable(const sockaddr* sa) {
  if (IsLoopback(sa)) return "";
  char text[INET6_ADDRSTRLEN] = {};
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    if (in->sin_addr.s_addr == htonl(INADDR_ANY)) return "";
    if (inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) == nullptr) return "";
    return text;
  }
  if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    if (IN6_IS_ADDR_UNSPECIFIED(&in6->sin6_addr) || IN6_IS_ADDR_LINKLOCAL(&in6->sin6_addr)) {
      return "";
    }
    if (inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text)) == nullptr) return "";
    return absl::StrCat("[", text, "]");
  }
  return "";
}

// The first dialable address `name` resolves to; empty with *why set if none.
std::string ResolveDialable(const std::string& name, std::string* why) {
  addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(name.c_str(), nullptr, &hints, &found);
  if (rc != 0) {
    *why = absl::StrCat("host name \"", name, "\" does not resolve (", gai_strerror(rc), ")");
    return "";
  }
  std::string address;
  for (const addrinfo* ai = found; ai != nullptr && address.empty(); ai = ai->ai_next) {
    address = Dialable(ai->ai_addr);
  }
  freeaddrinfo(found);
  if (address.empty()) {
    *why = absl::StrCat("host name \"", name, "\" resolves to loopback or link-local only");
  }
  return address;
}

// The interface of the default IPv4 route, from /proc/net/route; empty if
// there is none.
std::string DefaultRouteInterface() {
  std::ifstream routes("/proc/net/route");
  std::string line;
  std::getline(routes, line);  // the header
  while (std::getline(routes, line)) {
    std::istringstream fields(line);
    std::string interface, destination, gateway, flags, refcnt, use, metric, mask;
    if (!(fields >> interface >> destination >> gateway >> flags >> refcnt >> use >> metric >>
          mask)) {
      continue;
    }
    // RTF_UP is 0x1 in the flags column (hex).
    const bool up = (std::strtoul(flags.c_str(), nullptr, 16) & 0x1) != 0;
    if (up && destination == "00000000" && mask == "00000000") return interface;
  }
  return "";
}

}  // namespace

bool IsWildcardHost(absl::string_view host) {
  const std::string bare(Unbracketed(host));
  in_addr v4;
  if (inet_pton(AF_INET, bare.c_str(), &v4) == 1) return v4.s_addr == htonl(INADDR_ANY);
  in6_addr v6;
  if (inet_pton(AF_INET6, bare.c_str(), &v6) == 1) return IN6_IS_ADDR_UNSPECIFIED(&v6) != 0;
  return false;
}

absl::StatusOr<std::string> CanonicalHost(absl::string_view host, absl::string_view field) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": \"", absl::CHexEscape(host.substr(0, 64)),
                     host.size() > 64 ? "..." : "", "\" is not a host (", why, ")"));
  };
  if (host.empty()) return bad("empty");
  if (host.size() > kMaxHostBytes + 2) return bad("too long");
  if (IsWildcardHost(host)) return bad("a wildcard address, which no peer can dial");
  const absl::string_view bare = Unbracketed(host);
  if (bare.find(':') != absl::string_view::npos) {
    in6_addr v6;
    if (inet_pton(AF_INET6, std::string(bare).c_str(), &v6) != 1) {
      return bad("neither a host name nor an IPv6 address; give the host without a port");
    }
    return absl::StrCat("[", bare, "]");
  }
  if (bare.size() != host.size()) return bad("brackets around something not an IPv6 address");
  for (const char c : host) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_') {
      return bad("bad character in host");
    }
  }
  return std::string(host);
}

std::vector<InterfaceAddress> NonLoopbackIpv4Addresses() {
  std::vector<InterfaceAddress> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (const ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_addr == nullptr || ifa->ifa_addr->sa_family != AF_INET) continue;
    if ((ifa->ifa_flags & IFF_UP) == 0 || (ifa->ifa_flags & IFF_LOOPBACK) != 0) continue;
    std::string address = Dialable(ifa->ifa_addr);
    if (!address.empty()) out.push_back({ifa->ifa_name, std::move(address)});
  }
  freeifaddrs(list);
  return out;
}

absl::StatusOr<std::string> PrimaryHostAddress() {
  std::vector<std::string> tried;
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0') {
    std::string why;
    std::string address = ResolveDialable(name, &why);
    if (!address.empty()) return address;
    tried.push_back(std::move(why));
  } else {
    tried.push_back("gethostname() gives no name");
  }
  const std::vector<InterfaceAddress> interfaces = NonLoopbackIpv4Addresses();
  const std::string route = DefaultRouteInterface();
  if (route.empty()) {
    tried.push_back("no default IPv4 route");
  } else {
    for (const InterfaceAddress& a : interfaces) {
      if (a.interface == route) return a.address;
    }
    tried.push_back(absl::StrCat("the default route's interface ", route, " has no IPv4 address"));
  }
  if (interfaces.size() == 1) return interfaces[0].address;
  tried.push_back(interfaces.empty()
                      ? std::string("no interface other than loopback has an IPv4 address")
                      : absl::StrCat(interfaces.size(),
                                     " interfaces have IPv4 addresses, none of them the primary"));
  return absl::NotFoundError(
      absl::StrCat("no address of this machine for peers to dial: ", absl::StrJoin(tried, "; ")));
}

}  // namespace zeroshard::transport
