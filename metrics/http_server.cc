#include "metrics/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "civetweb.h"
#include "prometheus/text_serializer.h"

namespace zeroshard::metrics {
namespace {

struct ListenAddress {
  std::string civetweb_ports;  // "127.0.0.1:0", "[::1]:0", "9464" (all).
  bool ipv6 = false;
  sockaddr_storage addr = {};  // The same address, for ProbeBind.
  socklen_t addr_len = 0;
};

absl::Status ParseListenAddress(absl::string_view address, ListenAddress* out) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics listen address \"", address, "\" is not HOST:PORT"));
  }
  absl::string_view host = address.substr(0, colon);
  const absl::string_view port_text = address.substr(colon + 1);
  uint32_t port = 0;
  if (port_text.empty() || !absl::SimpleAtoi(port_text, &port) ||
      port > 65535 ||
      port_text.find_first_not_of("0123456789") != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics listen address \"", address,
                     "\": port must be a number in 0..65535"));
  }
  if (host == "localhost") host = "127.0.0.1";
  auto* v4 = reinterpret_cast<sockaddr_in*>(&out->addr);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&out->addr);
  if (host.empty()) {
    out->civetweb_ports = absl::StrCat(port);
    v4->sin_family = AF_INET;
    v4->sin_port = htons(port);
    v4->sin_addr.s_addr = htonl(INADDR_ANY);
    out->addr_len = sizeof(sockaddr_in);
    return absl::OkStatus();
  }
  if (host.front() == '[' && host.back() == ']' && host.size() > 2) {
    const std::string inner(host.substr(1, host.size() - 2));
    if (inet_pton(AF_INET6, inner.c_str(), &v6->sin6_addr) == 1) {
      out->civetweb_ports = absl::StrCat(host, ":", port);
      out->ipv6 = true;
      v6->sin6_family = AF_INET6;
      v6->sin6_port = htons(port);
      out->addr_len = sizeof(sockaddr_in6);
      return absl::OkStatus();
    }
  } else {
    const std::string ip(host);
    if (inet_pton(AF_INET, ip.c_str(), &v4->sin_addr) == 1) {
      out->civetweb_ports = absl::StrCat(host, ":", port);
      v4->sin_family = AF_INET;
      v4->sin_port = htons(port);
      out->addr_len = sizeof(sockaddr_in);
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "metrics listen address \"", address,
      "\": host must be a numeric IPv4 address, [IPv6], localhost or empty"));
}

// Why binding `address` fails ("Address already in use"), or "" if it does
// not: civetweb only says that it could not set up its ports.
std::string ProbeBind(const ListenAddress& address) {
  const int fd = socket(address.addr.ss_family, SOCK_STREAM, 0);
  if (fd < 0) return "";
  const int on = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));  // As civetweb.
  std::string reason;
  if (bind(fd, reinterpret_cast<const sockaddr*>(&address.addr),
           address.addr_len) != 0) {
    reason = std::strerror(errno);
  }
  close(fd);
  return reason;
}

// Connects to and hangs up on the server at `port` on loopback, so that its
// accept loop, which otherwise checks for mg_stop only every 2 s, wakes up.
void Poke(int port, bool ipv6) {
  const int fd = socket(ipv6 ? AF_INET6 : AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return;
  if (ipv6) {
    sockaddr_in6 addr = {};
    addr.sin6_family = AF_INET6;
    addr.sin6_port = htons(port);
    addr.sin6_addr = in6addr_loopback;
    connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  } else {
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  }
  close(fd);
}

// What prometheus::TextSerializer writes: the text format, version 0.0.4.
constexpr absl::string_view kTextContentType = "text/plain; version=0.0.4; charset=utf-8";

// civetweb would print connection-level errors (client resets, timeouts) to
// stderr; a scrape endpoint has nothing useful to do with them.
int DropLogMessage(const mg_connection*, const char*) { return 1; }

void SendEmpty(mg_connection* connection, int status, const char* allow) {
  mg_response_header_start(connection, status);
  mg_response_header_add(connection, "Content-Type", "text/plain", -1);
  if (allow != nullptr) mg_response_header_add(connection, "Allow", allow, -1);
  mg_response_header_add(connection, "Content-Length", "0", -1);
  mg_response_header_send(connection);
}

}  // namespace

MetricsHttpServer::MetricsHttpServer(const prometheus::Collectable& registry,
                                     std::string listen_address,
                                     PageRenderer page)
    : registry_(registry),
      listen_address_(std::move(listen_address)),
      page_(std::move(page)) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

absl::Status MetricsHttpServer::Start() {
  if (context_ != nullptr) {
    return absl::FailedPreconditionError("metrics server already started");
  }
  ListenAddress address;
  if (absl::Status s = ParseListenAddress(listen_address_, &address); !s.ok()) {
    return s;
  }
  // Each connection holds one of kThreads workers until it is answered or
  // its client stalls past kRequestTimeoutMs: a few slow clients (a request
  // trickled in, a response not read) leave workers for the scrapes.
  static constexpr char kThreads[] = "8";
  static constexpr char kRequestTimeoutMs[] = "3000";
  static std::once_flag init_once;
  std::call_once(init_once, [] { mg_init_library(0); });

  // clang-format off
  const char* options[] = {
      "listening_ports", address.civetweb_ports.c_str(),
      "num_threads", kThreads,
      "request_timeout_ms", kRequestTimeoutMs,
      "enable_keep_alive", "no",
      nullptr,
  };
  // clang-format on
  mg_callbacks callbacks = {};
  callbacks.log_message = DropLogMessage;
  // Every request goes through HandleRequest, from the first one accepted.
  callbacks.begin_request = &MetricsHttpServer::HandleRequest;
  mg_init_data init = {};
  init.callbacks = &callbacks;
  init.user_data = this;
  init.configuration_options = options;
  char error_text[256] = {};
  unsigned error_code = 0;
  mg_error_data error = {};
  error.code = &error_code;
  error.text = error_text;
  error.text_buffer_size = sizeof(error_text);

  mg_context* context = mg_start2(&init, &error);
  if (context == nullptr) {
    const std::string reason = ProbeBind(address);
    const char* detail =
        error_text[0] != '\0' ? error_text : "civetweb did not start";
    return absl::UnavailableError(absl::StrCat(
        "cannot serve metrics on ", listen_address_, ": ",
        reason.empty() ? detail : absl::StrCat(reason, " (", detail, ")")));
  }
  mg_server_port bound[4] = {};
  const int count = mg_get_server_ports(context, 4, bound);
  if (count < 1 || bound[0].port <= 0) {
    mg_stop(context);
    return absl::InternalError(absl::StrCat(
        "metrics server on ", listen_address_, " reports no bound port"));
  }
  context_ = context;
  port_ = bound[0].port;
  ipv6_ = address.ipv6;
  return absl::OkStatus();
}

void MetricsHttpServer::Stop() {
  if (context_ == nullptr) return;
  // mg_stop blocks until civetweb's accept loop sees the stop flag, which it
  // checks after each connection or 2 s of none: connect until it is done.
  // (A server bound to one non-loopback address is not reachable this way and
  // takes the 2 s.)
  std::atomic<bool> stopped{false};
  std::thread poker([this, &stopped] {
    while (!stopped.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      if (!stopped.load()) Poke(port_, ipv6_);
    }
  });
  mg_stop(context_);
  stopped = true;
  poker.join();
  context_ = nullptr;
  port_ = 0;
}

int MetricsHttpServer::HandleRequest(mg_connection* connection) {
  const mg_request_info* info = mg_get_request_info(connection);
  const absl::string_view uri =
      info != nullptr && info->local_uri != nullptr ? info->local_uri : "";
  const absl::string_view method =
      info != nullptr && info->request_method != nullptr ? info->request_method
                                                         : "";
  const auto* server = static_cast<const MetricsHttpServer*>(
      info != nullptr ? info->user_data : nullptr);
  const bool page = uri == "/" && server != nullptr && server->page_ != nullptr;
  if (uri != "/metrics" && !page) {
    SendEmpty(connection, 404, nullptr);
    return 404;
  }
  const bool head = method == "HEAD";
  if (method != "GET" && !head) {
    SendEmpty(connection, 405, "GET, HEAD");
    return 405;
  }
  const std::string body =
      page ? server->page_()
           : prometheus::TextSerializer().Serialize(server->registry_.Collect());
  const std::string length = absl::StrCat(body.size());
  mg_response_header_start(connection, 200);
  if (page) {
    mg_response_header_add(connection, "Content-Type",
                           "text/html; charset=utf-8", -1);
    // No script, no frame, nothing fetched: the page is one document with
    // inline styles.
    mg_response_header_add(connection, "Content-Security-Policy",
                           "default-src 'none'; style-src 'unsafe-inline'; "
                           "frame-ancestors 'none'; base-uri 'none'; "
                           "form-action 'none'",
                           -1);
    mg_response_header_add(connection, "X-Content-Type-Options", "nosniff", -1);
    mg_response_header_add(connection, "Referrer-Policy", "no-referrer", -1);
  } else {
    mg_response_header_add(connection, "Content-Type", kTextContentType.data(),
                           static_cast<int>(kTextContentType.size()));
  }
  mg_response_header_add(connection, "Content-Length", length.c_str(), -1);
  mg_response_header_add(connection, "Cache-Control", "no-store", -1);
  mg_response_header_send(connection);
  if (!head) mg_write(connection, body.data(), body.size());
  return 200;
}

}  // namespace zeroshard::metrics
