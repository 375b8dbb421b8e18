#include "server/status_page.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/estimator.h"
#include "common/format.h"
#include "common/job_spec.h"
#include "server/cache/param_cache.h"

namespace zeroshard {
namespace {

// Renders between two measurements closer than this keep the last rate.
constexpr absl::Duration kMinRateWindow = absl::Seconds(1);
// Ranks listed per job at most (the page stays small for a large N_d).
constexpr size_t kMaxRanksShown = 64;

constexpr char kStyle[] =
    "body{font:14px/1.4 sans-serif;margin:16px 24px;color:#222;background:#fff}"
    "h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:20px 0 4px}"
    "p.meta{color:#555;margin:0 0 12px}"
    "table{border-collapse:collapse;margin:6px 0}"
    "th,td{padding:3px 10px;border-bottom:1px solid #ddd;text-align:left;white-space:nowrap}"
    "th{background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}"
    "td.track{width:360px;padding:3px 0}"
    "div.bar{height:12px;background:#4a78c8;min-width:1px}"
    "div.bar.sum{background:#2e4f8a}div.bar.formula{background:#d98c1f}"
    "tr.sum td{font-weight:bold}p.note{color:#555;font-size:12px;max-width:900px}"
    "tr.silent td{color:#b00020}";

// The paper's per-rank model-state formula of `stage` (README's table).
const char* PaperFormula(uint32_t stage) {
  switch (stage) {
    case 1:
      return "4\u03a8 + K\u03a8/N_d";
    case 2:
      return "2\u03a8 + (2+K)\u03a8/N_d";
    case 3:
      return "(4+K)\u03a8/N_d";
    default:
      return "16\u03a8";
  }
}

// What one render shows of a job, copied out under the job's own locks.
struct JobView {
  std::string id;
  uint32_t stage = 0;
  uint32_t world_size = 0;
  uint32_t connected = 0;
  uint32_t joined = 0;
  uint64_t step = 0;
  double steps_per_second = -1;
  uint64_t parameters = 0;
  size_t owned_partitions = 0;
  uint64_t owned_elements = 0;
  uint64_t formula_bytes = 0;  // the paper's partitioned terms for the owned elements
  double k = kAdamK;
  CategoryBytes bytes{};
  uint64_t state_disk_bytes = 0;  // the state file on --state_dir
  bool node_cache = false;  // JobSpec.node_cache, with other daemons to cache
  ParamCache::Counts cache;
  std::vector<RankStatus> ranks;  // the first kMaxRanksShown
  size_t ranks_not_shown = 0;
};

std::string Bytes(uint64_t bytes) {
  return HtmlEscape(absl::StrCat(FormatBytes(static_cast<double>(bytes)), " (", bytes, " B)"));
}

// A bar `bytes` / `scale` of the track wide.
std::string Bar(uint64_t bytes, uint64_t scale, const char* extra_class) {
  const double percent =
      scale == 0 ? 0.0 : std::min(100.0, 100.0 * static_cast<double>(bytes) / scale);
  return absl::StrFormat(
      "<td class=\"track\"><div class=\"bar%s\" style=\"width:%.1f%%\"></div></td>", extra_class,
      percent);
}

// Each rank as this daemon last heard from it (heartbeats and pushes).
void AppendRanks(const JobView& j, std::string* out) {
  absl::StrAppend(out, "<h2>Ranks of job ", HtmlEscape(j.id),
                  "</h2>\n<table class=\"ranks\" id=\"ranks-", HtmlEscape(j.id),
                  "\">\n<tr><th>rank</th><th>state</th><th>incarnation</th>"
                  "<th>last heard</th><th>last step pushed</th></tr>\n");
  for (const RankStatus& r : j.ranks) {
    const char* state = r.connected          ? "connected"
                        : r.joined           ? "silent (past --rank_timeout)"
                        : r.incarnation == 0 ? "not joined"
                                             : "left";
    const bool silent = r.joined && !r.connected;
    absl::StrAppend(
        out, "<tr", silent ? " class=\"silent\"" : "", "><td class=\"n\">", r.rank, "</td><td>",
        state, "</td><td class=\"n\">", r.incarnation, "</td><td class=\"n\">",
        r.seconds_since_heard < 0 ? std::string("never")
                                  : absl::StrFormat("%.1f s ago", r.seconds_since_heard),
        "</td><td class=\"n\">",
        r.last_step_pushed == 0 ? std::string("\u2013") : absl::StrCat(r.last_step_pushed),
        "</td></tr>\n");
  }
  absl::StrAppend(out, "</table>\n");
  if (j.ranks_not_shown > 0) {
    absl::StrAppend(out, "<p class=\"note\">", j.ranks_not_shown,
                    " more rank(s) not listed (zsctl status shows every rank).</p>\n");
  }
}

void AppendMemory(const JobView& j, std::string* out) {
  uint64_t total = 0;
  uint64_t model_states = 0;
  for (int i = 0; i < kNumMemoryCategories; ++i) {
    total += j.bytes[i];
    const auto c = static_cast<MemoryCategory>(i);
    if (c != MemoryCategory::kActivation && c != MemoryCategory::kBuffer &&
        c != MemoryCategory::kFragmentation && c != MemoryCategory::kReplica &&
        c != MemoryCategory::kParamCache) {
      model_states += j.bytes[i];
    }
  }
  const uint64_t scale = std::max(total, j.formula_bytes);
  absl::StrAppend(out, "<h2>Memory of job ", HtmlEscape(j.id),
                  "</h2>\n<table class=\"memory\" id=\"memory-", HtmlEscape(j.id),
                  "\">\n<tr><th>ledger category</th><th></th><th>bytes</th></tr>\n");
  for (int i = 0; i < kNumMemoryCategories; ++i) {
    absl::StrAppend(out, "<tr><td>", HtmlEscape(MemoryCategoryName(static_cast<MemoryCategory>(i))),
                    "</td>", Bar(j.bytes[i], scale, ""), "<td class=\"n\">", Bytes(j.bytes[i]),
                    "</td></tr>\n");
  }
  absl::StrAppend(out, "<tr class=\"sum\"><td>model states</td>", Bar(model_states, scale, " sum"),
                  "<td class=\"n\">", Bytes(model_states), "</td></tr>\n");
  absl::StrAppend(out, "<tr class=\"sum\"><td>paper formula</td>",
                  Bar(j.formula_bytes, scale, " formula"), "<td class=\"n\">",
                  Bytes(j.formula_bytes), "</td></tr>\n");
  absl::StrAppend(out, "<tr class=\"sum\"><td>ledger total</td>", Bar(total, scale, " sum"),
                  "<td class=\"n\">", Bytes(total), "</td></tr>\n</table>\n");

  const double per_element =
      j.owned_elements == 0 ? 0.0 : static_cast<double>(j.formula_bytes) / j.owned_elements;
  std::string note = absl::StrCat(
      "Paper formula: the stage's partitioned model-state terms for the ", j.owned_partitions,
      " partition(s) this daemon owns (", j.owned_elements, " elements, ", FormatSig3(per_element),
      " B each), to compare with the model-state categories. ");
  absl::StatusOr<ModelStateEstimate> e = EstimateModelStates(
      static_cast<int>(j.stage), static_cast<double>(j.parameters), j.world_size, j.k);
  if (e.ok()) {
    absl::StrAppend(&note, "Per data-parallel rank the paper gives ", PaperFormula(j.stage), " = ",
                    FormatBytes(e->bytes_per_rank),
                    " (\u03a8 = ", FormatCount(static_cast<double>(j.parameters)),
                    ", N_d = ", j.world_size, ", K = ", FormatSig3(j.k), ").");
  }
  absl::StrAppend(out, "<p class=\"note\">", HtmlEscape(note), "</p>\n");
  if (j.state_disk_bytes > 0) {
    absl::StrAppend(
        out, "<p class=\"note\" id=\"state-disk-", HtmlEscape(j.id), "\">",
        HtmlEscape(absl::StrCat(
            "On disk (--state_dir): ", FormatBytes(static_cast<double>(j.state_disk_bytes)),
            " (", j.state_disk_bytes,
            " B) of fp32 masters and optimizer moments, outside the bars above (RAM).")),
        "</p>\n");
  }
  if (j.node_cache) {
    constexpr int kCacheCategory = static_cast<int>(MemoryCategory::kParamCache);
    absl::StrAppend(
        out, "<p class=\"note\" id=\"node-cache-", HtmlEscape(j.id), "\">",
        HtmlEscape(absl::StrCat(
            "Node cache: ", FormatBytes(static_cast<double>(j.bytes[kCacheCategory])),
            " held (param_cache); ", j.cache.hits, " gather(s) served from a copy, ",
            j.cache.fetches, " copies fetched from the owners, ",
            FormatBytes(static_cast<double>(j.cache.bytes_fetched)), " (", j.cache.bytes_fetched,
            " B) read from them.")),
        "</p>\n");
  }
}

}  // namespace

std::string HtmlEscape(absl::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

StatusPage::StatusPage(StatusPageSources sources) : sources_(std::move(sources)) {}

double StatusPage::UpdateRate(const Job* job, const std::string& id, uint64_t step,
                              absl::Time now) {
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = rates_.try_emplace(id);
  Rate& r = it->second;
  if (inserted || r.job != job || step < r.step || now < r.at) {
    r = Rate{job, step, now, -1};
  } else if (now - r.at >= kMinRateWindow) {
    r.per_second = static_cast<double>(step - r.step) / absl::ToDoubleSeconds(now - r.at);
    r.step = step;
    r.at = now;
  }
  return r.per_second;
}

void StatusPage::ForgetRatesExcept(const std::map<std::string, const Job*>& alive) {
  absl::MutexLock lock(&mu_);
  for (auto it = rates_.begin(); it != rates_.end();) {
    it = alive.count(it->first) == 0 ? rates_.erase(it) : std::next(it);
  }
}

std::string StatusPage::Render(absl::Time now) {
  // Copy everything out first, each source under its own lock.
  std::vector<std::shared_ptr<Job>> jobs;
  if (sources_.jobs) jobs = sources_.jobs();
  // One view per job: a replicated job's copies of replica groups share its
  // ledger entry; the primary copies speak for it.
  std::sort(jobs.begin(), jobs.end(), [](const auto& a, const auto& b) {
    return std::make_pair(a->config().job_id, a->role() != ReplicaRole::kPrimary) <
           std::make_pair(b->config().job_id, b->role() != ReplicaRole::kPrimary);
  });
  jobs.erase(std::unique(jobs.begin(), jobs.end(),
                         [](const auto& a, const auto& b) {
                           return a->config().job_id == b->config().job_id;
                         }),
             jobs.end());
  std::sort(jobs.begin(), jobs.end(),
            [](const auto& a, const auto& b) { return a->config().job_id < b->config().job_id; });
  std::map<std::string, CategoryBytes> ledger;
  uint64_t ledger_total = 0;
  uint64_t ledger_limit = 0;
  if (sources_.ledger != nullptr) {
    ledger = sources_.ledger->Snapshot();
    ledger_total = sources_.ledger->total();
    ledger_limit = sources_.ledger->limit();
  }
  std::vector<JobView> views;
  std::map<std::string, const Job*> alive;
  for (const auto& job : jobs) {
    const JobConfig& c = job->config();
    JobView v;
    v.id = c.job_id;
    v.stage = c.stage;
    v.world_size = c.world_size;
    v.connected = job->RanksConnected(sources_.rank_timeout);
    v.joined = job->ranks_joined();
    v.step = job->committed_step();
    v.steps_per_second = UpdateRate(job.get(), v.id, v.step, now);
    v.parameters = c.layout.parameter_count();
    v.owned_partitions = job->owned_partitions().size();
    v.owned_elements = job->owned_range().size();
    v.formula_bytes = DaemonModelStateFormulaBytes(c, job->owned_range());
    v.k = c.optimizer.kind == OptimizerKind::kSgdMomentum ? 8.0 : kAdamK;
    if (auto it = ledger.find(v.id); it != ledger.end()) v.bytes = it->second;
    v.state_disk_bytes = job->state_disk_bytes();
    if (const ParamCache* cache = job->param_cache(); cache != nullptr) {
      v.node_cache = true;
      v.cache = cache->counts();
    }
    std::vector<RankStatus> ranks =
        job->StepState(sources_.rank_timeout, /*brief=*/false).ranks;
    const size_t shown = std::min<size_t>(ranks.size(), kMaxRanksShown);
    v.ranks_not_shown = ranks.size() - shown;
    ranks.resize(shown);
    v.ranks = std::move(ranks);
    alive.emplace(v.id, job.get());
    views.push_back(std::move(v));
  }
  ForgetRatesExcept(alive);

  std::string out;
  out.reserve(8192);
  absl::StrAppend(&out,
                  "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
                  "<meta http-equiv=\"refresh\" content=\"5\">\n"
                  "<title>zeroshardd status</title>\n<style>",
                  kStyle, "</style>\n</head>\n<body>\n<h1>zeroshardd</h1>\n<p class=\"meta\">",
                  HtmlEscape(absl::StrCat(
                      "version ", sources_.version, " \u00b7 up ",
                      absl::FormatDuration(absl::Trunc(now - sources_.start, absl::Seconds(1))),
                      " \u00b7 ", views.size(), " job(s) \u00b7 memory ",
                      FormatBytes(static_cast<double>(ledger_total)), " of ",
                      ledger_limit == 0 ? std::string("no limit")
                                        : FormatBytes(static_cast<double>(ledger_limit)),
                      " \u00b7 refreshes every 5 s")),
                  "</p>\n");
  if (views.empty()) {
    absl::StrAppend(&out, "<p id=\"no-jobs\">No jobs registered.</p>\n");
  } else {
    absl::StrAppend(&out,
                    "<table id=\"jobs\">\n<tr><th>job</th><th>stage</th><th>N_d</th>"
                    "<th>ranks connected</th><th>committed step</th><th>steps/s</th>"
                    "<th>\u03a8</th><th>partitions owned</th><th>ledger</th>"
                    "<th>paper formula</th></tr>\n");
    for (const JobView& v : views) {
      uint64_t total = 0;
      for (uint64_t b : v.bytes) total += b;
      absl::StrAppend(
          &out, "<tr class=\"job\" id=\"job-", HtmlEscape(v.id), "\"><td>", HtmlEscape(v.id),
          "</td><td class=\"n\">", v.stage, "</td><td class=\"n\">", v.world_size,
          "</td><td class=\"n\">", HtmlEscape(absl::StrCat(v.connected, " / ", v.world_size)),
          v.joined != v.connected ? HtmlEscape(absl::StrCat(" (", v.joined, " joined)")) : "",
          "</td><td class=\"n\">", v.step, "</td><td class=\"n\">",
          v.steps_per_second < 0 ? "\u2013" : HtmlEscape(FormatSig3(v.steps_per_second)),
          "</td><td class=\"n\">", HtmlEscape(FormatCount(static_cast<double>(v.parameters))),
          "</td><td class=\"n\">", v.owned_partitions, "</td><td class=\"n\">",
          HtmlEscape(FormatBytes(static_cast<double>(total))), "</td><td class=\"n\">",
          HtmlEscape(FormatBytes(static_cast<double>(v.formula_bytes))), "</td></tr>\n");
    }
    absl::StrAppend(&out, "</table>\n");
    for (const JobView& v : views) {
      AppendRanks(v, &out);
      AppendMemory(v, &out);
    }
  }
  // Ledger entries of no registered job: the daemon's own (the activation
  // arena's free space) and removed jobs whose memory is still leased.
  std::string others;
  for (const auto& [name, bytes] : ledger) {
    if (alive.count(name) != 0) continue;
    uint64_t total = 0;
    for (uint64_t b : bytes) total += b;
    absl::StrAppend(&others, "<tr><td>", HtmlEscape(name), "</td><td class=\"n\">", Bytes(total),
                    "</td></tr>\n");
  }
  if (!others.empty()) {
    absl::StrAppend(&out,
                    "<h2>Other ledger entries</h2>\n<table id=\"other-ledger\">\n"
                    "<tr><th>entry</th><th>bytes</th></tr>\n",
                    others, "</table>\n");
  }
  absl::StrAppend(&out, "</body>\n</html>\n");
  return out;
}

std::function<std::string()> StatusPageRenderer(StatusPageSources sources) {
  auto page = std::make_shared<StatusPage>(std::move(sources));
  return [page] { return page->Render(); };
}

}  // namespace zeroshard
