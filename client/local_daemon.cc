#include "client/local_daemon.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

// An IPv4 or IPv6 address as comparable bytes, or "" for another family.
std::string AddressBytes(const sockaddr* a) {
  if (a == nullptr) return "";
  if (a->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(a);
    return std::string(reinterpret_cast<const char*>(&in->sin_addr), sizeof(in->sin_addr));
  }
  if (a->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a);
    return std::string(reinterpret_cast<const char*>(&in6->sin6_addr), sizeof(in6->sin6_addr));
  }
  return "";
}

bool IsLoopback(const sockaddr* a) {
  if (a->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(a);
    return (ntohl(in->sin_addr.s_addr) >> 24) == 127;
  }
  if (a->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a);
    return IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr);
  }
  return false;
}

}  // namespace

std::string HostOfAddress(absl::string_view address) {
  if (absl::StartsWith(address, "unix:")) return "localhost";  // a socket of this machine
  const size_t colon = address.rfind(':');
  absl::string_view host = colon == absl::string_view::npos ? address : address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return std::string(host);
}

absl::StatusOr<int> FindLocalDaemon(const std::vector<std::string>& daemons) {
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) {
    return absl::UnavailableError(
        absl::StrCat("listing this machine's interfaces (getifaddrs): ", std::strerror(errno)));
  }
  std::set<std::string> mine;
  for (const ifaddrs* i = interfaces; i != nullptr; i = i->ifa_next) {
    const std::string bytes = AddressBytes(i->ifa_addr);
    if (!bytes.empty()) mine.insert(bytes);
  }
  freeifaddrs(interfaces);
  for (size_t d = 0; d < daemons.size(); ++d) {
    const std::string host = HostOfAddress(daemons[d]);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) continue;
    bool local = false;
    for (const addrinfo* a = found; a != nullptr && !local; a = a->ai_next) {
      local = IsLoopback(a->ai_addr) || mine.count(AddressBytes(a->ai_addr)) > 0;
    }
    freeaddrinfo(found);
    if (local) return static_cast<int>(d);
  }
  return -1;
}

}  // namespace zeroshard
