// The status page at "/" of a daemon's metrics port: the job's row and its
// memory by ledger category beside the paper's formula, the headers that
// keep it inert (HTML, a CSP with no script), escaping, and steps per
// second from the committed step.

#include "server/status_page.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/format.h"
#include "common/job_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "metrics/promtool_testutil.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using metrics::testing::Fetch;
using metrics::testing::HttpResponse;
using testing::DaemonClient;
using testing::GradientChunks;
using ::testing::HasSubstr;
using testing::MakeSpec;
using ::testing::Not;
using testing::SampleLayout;

constexpr char kJob[] = "page.job-1";

// A daemon serving metrics on loopback with a stage-3, N_d = 2 job whose
// ranks have joined.
class StatusPageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DaemonOptions options;
    options.listen = "127.0.0.1:0";
    options.metrics_listen = "127.0.0.1:0";
    options.version = "dev<b>&\"'";
    options.activation_arena_bytes = 1 << 20;
    auto daemon = Daemon::Start(options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
    ASSERT_GT(daemon_->metrics_port(), 0);
    client_ = std::make_unique<DaemonClient>(daemon_->address());
    spec_ = MakeSpec(kJob, SampleLayout(), 3, 2, {daemon_->address()});
    spec_.set_precision(v1::DTYPE_BF16);
    config_ = *ParseJobSpec(spec_);
    ASSERT_TRUE(client_->Register(spec_, 0).ok());
    ASSERT_TRUE(client_->JoinAll(spec_).ok());
  }

  // Both ranks push, then the step is prepared and committed.
  void Step(uint64_t step) {
    const uint64_t n = config_.map.total_elements();
    std::vector<float> g(n, 0.25f);
    for (uint32_t r = 0; r < 2; ++r) {
      ASSERT_TRUE(
          client_->Push(GradientChunks(kJob, step, r, config_.map, {0, n}, g.data(), 700)).ok());
    }
    v1::PrepareStepResponse p;
    ASSERT_TRUE(client_->Prepare(kJob, step, &p).ok());
    ASSERT_TRUE(client_->Commit(kJob, step, 0.01f).ok());
  }

  StatusPageSources Sources() {
    Daemon* d = daemon_.get();
    return {"v", [d] { return d->jobs().All(); }, absl::Seconds(30), &d->ledger(), absl::Now()};
  }

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<DaemonClient> client_;
  v1::JobSpec spec_;
  JobConfig config_;
};

TEST_F(StatusPageTest, ServesTheJobsRowAndMemoryAtRoot) {
  Step(1);
  const HttpResponse page = Fetch(daemon_->metrics_port(), "GET", "/");
  ASSERT_EQ(page.status, 200) << page.headers;
  EXPECT_THAT(page.headers, HasSubstr("Content-Type: text/html; charset=utf-8"));
  EXPECT_THAT(page.headers, HasSubstr("Content-Security-Policy: default-src 'none'; "
                                      "style-src 'unsafe-inline'"));
  const std::string& body = page.body;
  EXPECT_THAT(body, HasSubstr("<meta http-equiv=\"refresh\" content=\"5\">"));

  // The job's row: id, stage, N_d, ranks connected of expected, step.
  const std::string row = absl::StrCat("<tr class=\"job\" id=\"job-", kJob, "\"><td>", kJob,
                                       "</td><td class=\"n\">3</td><td class=\"n\">2</td>"
                                       "<td class=\"n\">2 / 2</td><td class=\"n\">1</td>");
  EXPECT_THAT(body, HasSubstr(row)) << body;
  EXPECT_THAT(body, HasSubstr(absl::StrCat("id=\"memory-", kJob, "\"")));

  // Each rank as the daemon last heard from it: both connected, step 1 pushed.
  EXPECT_THAT(body, HasSubstr(absl::StrCat("id=\"ranks-", kJob, "\"")));
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(body, HasSubstr(absl::StrCat("<tr><td class=\"n\">", r,
                                             "</td><td>connected</td><td class=\"n\">1</td>")))
        << body;
  }
  EXPECT_THAT(body, HasSubstr(" s ago</td><td class=\"n\">1</td></tr>"));

  // Every category with the ledger's bytes, and the paper's formula beside.
  const CategoryBytes ledger = daemon_->ledger().JobBytes(kJob);
  for (int i = 0; i < kNumMemoryCategories; ++i) {
    EXPECT_THAT(body, HasSubstr(absl::StrCat(
                          "<td>", MemoryCategoryName(static_cast<MemoryCategory>(i)), "</td>")));
    EXPECT_THAT(body, HasSubstr(absl::StrCat("(", ledger[i], " B)")));
  }
  const std::shared_ptr<Job> job = *daemon_->jobs().Find(kJob);
  const uint64_t formula = DaemonModelStateFormulaBytes(config_, job->owned_range());
  EXPECT_GT(formula, 0u);
  EXPECT_THAT(body, HasSubstr(absl::StrCat("<td>paper formula</td>")));
  EXPECT_THAT(body, HasSubstr(absl::StrCat("(", formula, " B)")));
  EXPECT_THAT(body, HasSubstr("(4+K)\u03a8/N_d"));
  EXPECT_THAT(body, HasSubstr("class=\"bar formula\" style=\"width:"));
  // The daemon's own ledger entry (the arena's free space).
  EXPECT_THAT(body, HasSubstr("<td>(daemon)</td>"));

  // Strings are escaped; nothing secret or active is printed.
  EXPECT_THAT(body, HasSubstr("version dev&lt;b&gt;&amp;&quot;&#39;"));
  EXPECT_THAT(body, Not(HasSubstr("<b>")));
  EXPECT_THAT(body, Not(HasSubstr("<script")));
  EXPECT_THAT(body, Not(HasSubstr(testing::kTestToken)));
  EXPECT_THAT(body, Not(HasSubstr("http://")));
  EXPECT_THAT(body, Not(HasSubstr("https://")));

  // /metrics is still served.
  EXPECT_EQ(Fetch(daemon_->metrics_port(), "GET", "/metrics").status, 200);
}

TEST_F(StatusPageTest, StepsPerSecondFromTheCommittedStep) {
  StatusPage page(Sources());
  const absl::Time t0 = absl::Now();
  const std::string first = page.Render(t0);
  EXPECT_THAT(first, HasSubstr("<td class=\"n\">0</td><td class=\"n\">\u2013</td>")) << first;
  Step(1);
  Step(2);
  // Less than a second later: still not measured.
  EXPECT_THAT(page.Render(t0 + absl::Milliseconds(500)),
              HasSubstr("<td class=\"n\">2</td><td class=\"n\">\u2013</td>"));
  // Two steps in four seconds.
  EXPECT_THAT(page.Render(t0 + absl::Seconds(4)),
              HasSubstr("<td class=\"n\">2</td><td class=\"n\">0.500</td>"));
  // No step since: the next window measures 0, and keeps it within a second.
  EXPECT_THAT(page.Render(t0 + absl::Seconds(6)),
              HasSubstr("<td class=\"n\">2</td><td class=\"n\">0</td>"));
}

TEST_F(StatusPageTest, ALeftJobLeavesThePage) {
  StatusPage page(Sources());
  EXPECT_THAT(page.Render(), HasSubstr(absl::StrCat("id=\"job-", kJob, "\"")));
  v1::LeaveRequest leave;
  leave.set_job_id(kJob);
  leave.set_incarnation(testing::kTestIncarnation);
  for (uint32_t r = 0; r < 2; ++r) {
    leave.set_rank(r);
    v1::LeaveResponse resp;
    grpc::ClientContext ctx;  // The channel sends the job's token.
    ASSERT_TRUE(client_->control->Leave(&ctx, leave, &resp).ok());
  }
  const std::string body = page.Render();
  EXPECT_THAT(body, Not(HasSubstr(absl::StrCat("id=\"job-", kJob, "\""))));
  EXPECT_THAT(body, HasSubstr("No jobs registered."));
}

// A rank not heard from within the rank timeout is shown silent, in red,
// with how long ago it was last heard from.
TEST_F(StatusPageTest, ASilentRankIsMarked) {
  StatusPageSources sources = Sources();
  sources.rank_timeout = absl::Milliseconds(50);
  StatusPage page(sources);
  absl::SleepFor(absl::Milliseconds(150));
  const std::string body = page.Render();
  EXPECT_THAT(body, HasSubstr("<tr class=\"silent\"><td class=\"n\">0</td>"
                              "<td>silent (past --rank_timeout)</td>"))
      << body;
  EXPECT_THAT(body, HasSubstr("0 / 2 (2 joined)"));
  EXPECT_THAT(body, HasSubstr("tr.silent td{color:#b00020}"));
}

TEST(HtmlEscape, EscapesEveryMarkupCharacter) {
  EXPECT_EQ(HtmlEscape("a<b>&\"'c\u03a8"), "a&lt;b&gt;&amp;&quot;&#39;c\u03a8");
  EXPECT_EQ(HtmlEscape(""), "");
  EXPECT_EQ(HtmlEscape("run-42.a_b"), "run-42.a_b");
}

}  // namespace
}  // namespace zeroshard
