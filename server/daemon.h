#pragma once

// zeroshardd's process-wide state and its gRPC services (Control, Shard,
// Admin). Handlers run on gRPC's synchronous-server threads; the only waits
// inside them (a gather waiting for a commit, a stream reading its next
// chunk) are bounded by a deadline. The optimizer step runs on the daemon's
// ShardOptimizer threads, which the handler thread joins.

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "metrics/http_server.h"
#include "metrics/registry.h"
#include "server/daemon_metrics.h"
#include "server/job_registry.h"
#include "server/memory_ledger.h"
#include "server/optimizer/optimizer.h"
#include "transport/transport.h"

namespace zeroshard {

struct DaemonOptions {
  std::string listen = "127.0.0.1:0";  // HOST:PORT; port 0 picks a free one
  uint64_t memory_limit_bytes = 0;     // 0 = unlimited
  int optimizer_threads = 1;
  uint64_t max_chunk_bytes = 4ull << 20;  // gather chunk size
  std::string version = "dev";
  // HOST:PORT of the Prometheus /metrics endpoint; empty = off; port 0 picks.
  std::string metrics_listen;
  // Serve the UCX bulk data path: a UCX transport is created at start (a
  // failure is logged and leaves the gRPC path only), job parameters are
  // allocated through it, and ExchangeEndpoint hands out regions. zeroshardd
  // turns it on by default (--ucx).
  bool ucx = false;
  // UCX_TLS for that transport; empty = UCX's choice.
  std::string ucx_tls;
};

class DaemonServices;

class Daemon {
 public:
  // Binds `options.listen` and starts serving. InvalidArgument for bad
  // options, Unavailable when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonOptions& options);
  ~Daemon();

  // The bound port and "HOST:PORT" with it.
  int port() const { return port_; }
  // The bound /metrics port, or 0 when metrics are off.
  int metrics_port() const;
  const std::string& address() const { return address_; }

  // Stops accepting RPCs and waits up to `grace` for those in flight, then
  // cancels the rest. Idempotent.
  void Shutdown(absl::Duration grace);
  // Blocks until Shutdown has completed.
  void Wait();

  JobRegistry& jobs() { return jobs_; }
  MemoryLedger& ledger() { return ledger_; }
  // Whether the UCX data path is being served (see DaemonOptions::ucx).
  bool ucx_enabled() const { return transport_ != nullptr; }
  const metrics::Registry& registry() const { return registry_; }

 private:
  explicit Daemon(const DaemonOptions& options);

  // Declaration order is destruction order in reverse: jobs release ledger
  // bytes, which update metrics, which live in the registry.
  DaemonOptions options_;
  metrics::Registry registry_;
  MemoryLedger ledger_;
  DaemonMetrics metrics_;
  std::unique_ptr<transport::Transport> transport_;  // null: gRPC data path only
  JobRegistry jobs_;
  std::unique_ptr<ShardOptimizer> optimizer_;
  std::unique_ptr<DaemonServices> services_;
  std::unique_ptr<metrics::MetricsHttpServer> http_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace zeroshard
