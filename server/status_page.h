#pragma once

// The daemon's status page, served at "/" of the metrics port
// (metrics::MetricsHttpServer's page renderer): one HTML document with no
// script and no external resource that reloads itself every 5 s. For each
// registered job: its stage, N_d, ranks connected of expected, committed
// step and steps per second, Ψ and the partitions this daemon owns; and the
// job's ledger bytes by category as bars, beside the paper's formula for
// the owned partitions (what Admin.MemoryReport calls formula_bytes) and
// the paper's per-rank model states for the stage (common/estimator.h);
// for a job with a node cache, a line with its param_cache bytes, hits,
// copies fetched and bytes fetched (ParamCache::counts()).
//
// Like /metrics it needs no credentials, so it shows no more than /metrics
// does: job ids, counts and byte counts; never tokens or parameter values.
// Every string it prints is HTML-escaped.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/job/job.h"
#include "server/ledger/memory_ledger.h"

namespace zeroshard {

// Where the page reads from; everything borrowed must outlive the page.
struct StatusPageSources {
  std::string version;
  // The registered jobs (JobManager::All).
  std::function<std::vector<std::shared_ptr<Job>>()> jobs;
  // A joined rank heard from within this counts as connected.
  absl::Duration rank_timeout = absl::Seconds(30);
  const MemoryLedger* ledger = nullptr;
  absl::Time start;  // when the daemon started (the page shows its uptime)
};

class StatusPage {
 public:
  explicit StatusPage(StatusPageSources sources);

  // The page as of `now`. Thread-safe; runs on the caller's thread (a
  // civetweb worker). Reads the job list, each job's rank table and atomics,
  // and one ledger snapshot, each under its own lock held only for the copy,
  // so it never waits for a step. Steps per second is measured between
  // renders at least a second apart (shown once two have been seen).
  std::string Render(absl::Time now);
  std::string Render() { return Render(absl::Now()); }

 private:
  struct Rate {
    const Job* job = nullptr;  // identity only: a job registered again restarts the rate
    uint64_t step = 0;
    absl::Time at;
    double per_second = -1;  // < 0: not measured yet
  };

  // The steps per second of `job` at `step` (< 0: not measured yet), and
  // forgets jobs not in `alive`.
  double UpdateRate(const Job* job, const std::string& id, uint64_t step, absl::Time now);
  void ForgetRatesExcept(const std::map<std::string, const Job*>& alive);

  const StatusPageSources sources_;
  absl::Mutex mu_;
  std::map<std::string, Rate> rates_ ABSL_GUARDED_BY(mu_);
};

// A StatusPage over `sources`, as a metrics::PageRenderer (the copies of the
// returned function share the one page and its rates).
std::function<std::string()> StatusPageRenderer(StatusPageSources sources);

// `s` with & < > " ' replaced by character references: safe in element
// content and in quoted attribute values.
std::string HtmlEscape(absl::string_view s);

}  // namespace zeroshard
