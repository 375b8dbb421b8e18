#pragma once

// Serves a prometheus-cpp registry's metrics over HTTP for Prometheus to
// scrape: `GET /metrics` (and HEAD) answers 200 with prometheus-cpp's text
// exposition; with a page renderer, `GET /` (and HEAD) answers 200 with the
// HTML page it renders; any other path 404, any other method 405. (Not
// prometheus-cpp's Exposer: it serves only collectables, not the page.)
//
//   MetricsHttpServer server(registry, "0.0.0.0:9464");
//   RETURN_IF_ERROR(server.Start());

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "prometheus/collectable.h"

struct mg_context;
struct mg_connection;

namespace zeroshard::metrics {

// The HTML page served at "/": called once per request, on a civetweb worker
// thread (two may run at once), so it must be thread-safe and must not
// block for long. The page is sent as `text/html; charset=utf-8` under a
// Content-Security-Policy that allows no script and no external resource
// (inline styles only): the renderer HTML-escapes every string it prints.
using PageRenderer = std::function<std::string()>;

class MetricsHttpServer {
 public:
  // `registry` (a prometheus::Registry) is not owned and must outlive the
  // server; its Collect() runs on civetweb's worker threads.
  // `listen_address` is HOST:PORT with HOST a numeric IPv4 address, a
  // bracketed IPv6 address ("[::1]:9464"), "localhost" or empty (all
  // interfaces); port 0 picks a free port (see port()). Without `page`, "/" is 404 like any other path;
  // whatever `page` uses must outlive the server (or its Stop).
  MetricsHttpServer(const prometheus::Collectable& registry, std::string listen_address,
                    PageRenderer page = nullptr);
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;
  // Stops the server (see Stop).
  ~MetricsHttpServer();

  // Binds and starts serving on the server's own threads; returns once the
  // socket listens. InvalidArgument for a malformed address; Unavailable
  // when the address cannot be bound (in use, not local), with the reason;
  // FailedPrecondition if already started.
  absl::Status Start();

  // Stops accepting, waits for requests in flight to finish, closes the
  // socket; blocks for milliseconds normally, up to ~2 s when bound to a
  // single non-loopback address. Idempotent. Do not call concurrently with
  // Start.
  void Stop();

  // The bound port once started (the real one when asked for port 0), else 0.
  int port() const { return port_; }

 private:
  // civetweb's begin_request callback, on a civetweb worker thread.
  static int HandleRequest(mg_connection* connection);

  const prometheus::Collectable& registry_;
  const std::string listen_address_;
  const PageRenderer page_;
  mg_context* context_ = nullptr;
  int port_ = 0;
  bool ipv6_ = false;
};

}  // namespace zeroshard::metrics
