// The JobManager on its own (no gRPC): registration and its checks, the
// max_jobs bound, concurrent registrations, removal, retirement for the
// read lease and the janitor's reaping, with a real ledger to see what each
// step books and frees.

#include "server/job/job_manager.h"

#include <atomic>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "server/ledger/memory_ledger.h"
#include "server/metrics/daemon_metrics.h"
#include "server/optimizer/optimizer.h"

namespace zeroshard {

// Failure messages name the job copy instead of dumping its bytes.
void PrintTo(const Job& job, std::ostream* os) {
  *os << "job " << job.config().job_id << " group " << job.daemon_index() << " at " << &job;
}

namespace {

using ::testing::HasSubstr;

const TokenDigest kOwner = TokenDigest::Of("the-owner-token-0123456789");
const TokenDigest kOther = TokenDigest::Of("another-token-0123456789");

// A small fp32 job `id` over `daemons` daemons (placeholder addresses: the
// manager never dials them).
v1::JobSpec Spec(const std::string& id, uint32_t daemons = 1, uint32_t replicas = 1) {
  JobSettings s;
  s.job_id = id;
  s.stage = 2;
  s.world_size = 4;
  s.precision = DType::kFp32;
  s.replicas = replicas;
  for (uint32_t d = 0; d < daemons; ++d) s.daemons.push_back(absl::StrCat("127.0.0.1:", 7000 + d));
  const Layout layout = *Layout::Create({{"w", {1000}, DType::kFp32, 0},
                                         {"b", {37}, DType::kFp32, 0}});
  return ToJobSpec(s, layout);
}

v1::RegisterJobRequest Request(const v1::JobSpec& spec, uint32_t daemon_index = 0) {
  v1::RegisterJobRequest r;
  *r.mutable_spec() = spec;
  r.set_daemon_index(daemon_index);
  return r;
}

// A ledger, an optimizer and metrics, and a manager over them.
class JobManagerTest : public ::testing::Test {
 protected:
  JobManagerTest() : ledger_(0), metrics_(&registry_, &ledger_, "test") {
    optimizer_ = *ShardOptimizer::Create(ShardOptimizer::Options());
  }

  void Make(JobManager::Options o) {
    JobResources r;
    r.ledger = &ledger_;
    r.optimizer = optimizer_.get();
    r.metrics = &metrics_;
    manager_ = std::make_unique<JobManager>(o, r, &metrics_);
  }
  void SetUp() override {
    JobManager::Options o;
    o.read_lease = absl::ZeroDuration();
    o.janitor_period = absl::Hours(1);  // the tests call Tick themselves
    Make(o);
  }

  absl::StatusOr<std::shared_ptr<Job>> Register(const v1::JobSpec& spec,
                                                const TokenDigest& token = kOwner,
                                                bool* created = nullptr, bool draining = false,
                                                uint32_t daemon_index = 0, bool may_create = true,
                                                const std::string& identity = "anonymous",
                                                bool exempt = false) {
    bool ignored = false;
    JobManager::Registrant registrant;
    registrant.may_create = may_create;
    registrant.identity = identity;
    registrant.exempt = exempt;
    return manager_->Register(Request(spec, daemon_index), token, draining, registrant,
                              created != nullptr ? created : &ignored);
  }
  absl::StatusOr<std::shared_ptr<Job>> RegisterAs(const std::string& id,
                                                  const std::string& identity,
                                                  bool exempt = false) {
    return Register(Spec(id), kOwner, nullptr, false, 0, true, identity, exempt);
  }

  MemoryLedger ledger_;
  prometheus::Registry registry_;
  DaemonMetrics metrics_;
  std::unique_ptr<ShardOptimizer> optimizer_;
  std::unique_ptr<JobManager> manager_;
};

TEST_F(JobManagerTest, RegisterCreatesOnceThenFindsTheSameJob) {
  bool created = false;
  absl::StatusOr<std::shared_ptr<Job>> job = Register(Spec("a"), kOwner, &created);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_TRUE(created);
  EXPECT_TRUE((*job)->token().Matches(kOwner));
  EXPECT_FALSE((*job)->token().Matches(kOther));
  EXPECT_EQ((*job)->config().job_id, "a");
  EXPECT_GT(ledger_.total(), 0u) << "the job's memory is booked";
  EXPECT_EQ(manager_->size(), 1u);
  EXPECT_EQ(manager_->Find("a").value_or(nullptr), *job);
  EXPECT_EQ(manager_->Find("a", 0).value_or(nullptr), *job);
  EXPECT_THAT(manager_->All(), ::testing::ElementsAre(*job));
  // The same spec and token again: the registered job, nothing booked twice.
  const uint64_t booked = ledger_.total();
  absl::StatusOr<std::shared_ptr<Job>> again = Register(Spec("a"), kOwner, &created);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(created);
  EXPECT_EQ(*again, *job);
  EXPECT_EQ(ledger_.total(), booked);
  EXPECT_EQ(manager_->size(), 1u);
}

TEST_F(JobManagerTest, OneIdentityRegistersAtMostItsQuotaOfJobs) {
  JobManager::Options o;
  o.read_lease = absl::ZeroDuration();
  o.janitor_period = absl::Hours(1);
  o.max_jobs_per_identity = 2;
  Make(o);
  ASSERT_TRUE(RegisterAs("a1", "cert:CN=alice").ok());
  ASSERT_TRUE(RegisterAs("a2", "cert:CN=alice").ok());
  const uint64_t booked = ledger_.total();
  absl::StatusOr<std::shared_ptr<Job>> third = RegisterAs("a3", "cert:CN=alice");
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("--max_jobs_per_identity"));
  EXPECT_THAT(third.status().message(), HasSubstr("cert:CN=alice"));
  EXPECT_EQ(ledger_.total(), booked) << "nothing booked for the refused job";
  EXPECT_EQ(manager_->size(), 2u);
  // A registered job opens again for its identity whatever the count.
  EXPECT_TRUE(RegisterAs("a1", "cert:CN=alice").ok());
  // Other identities, and the exempt admin, are not held back by Alice.
  EXPECT_TRUE(RegisterAs("b1", "cert:CN=bob").ok());
  EXPECT_TRUE(RegisterAs("x1", "admin", /*exempt=*/true).ok());
  EXPECT_TRUE(RegisterAs("x2", "admin", /*exempt=*/true).ok());
  EXPECT_TRUE(RegisterAs("x3", "admin", /*exempt=*/true).ok());
  EXPECT_EQ(manager_->CountOf("cert:CN=alice"), 2u);
  // When one of Alice's jobs ends she may register another.
  manager_->Remove(*manager_->Find("a2"));
  EXPECT_TRUE(RegisterAs("a3", "cert:CN=alice").ok());
}

TEST_F(JobManagerTest, AJobsMemoryIsBookedUnderItsRegistrant) {
  ASSERT_TRUE(RegisterAs("a1", "cert:CN=alice").ok());
  const uint64_t alice = ledger_.total();
  EXPECT_GT(alice, 0u);
  EXPECT_EQ(ledger_.OwnerBytes("cert:CN=alice"), alice);
  ASSERT_TRUE(RegisterAs("x1", "admin", /*exempt=*/true).ok());
  EXPECT_EQ(ledger_.OwnerBytes("admin"), 0u) << "the admin's jobs count toward no quota";
  EXPECT_EQ(ledger_.OwnerBytes("cert:CN=alice"), alice);
  manager_->Remove(*manager_->Find("a1"));
  manager_->Tick();  // reaps it (no read lease here)
  EXPECT_EQ(ledger_.OwnerBytes("cert:CN=alice"), 0u);
}

TEST_F(JobManagerTest, FindNamesWhatIsMissing) {
  absl::StatusOr<std::shared_ptr<Job>> none = manager_->Find("nope");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(none.status().message(), HasSubstr("nope"));
  ASSERT_TRUE(Register(Spec("a")).ok());
  EXPECT_EQ(manager_->Find("nope", 0).status().code(), absl::StatusCode::kNotFound);
  // A group this daemon does not hold: NotFound naming the groups it holds.
  const absl::Status other = manager_->Find("a", 3).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(other.message(), HasSubstr("[0]"));
  EXPECT_THAT(other.message(), HasSubstr("group 3"));
}

TEST_F(JobManagerTest, RegisteredJobChecksTokenSpecAndIndex) {
  ASSERT_TRUE(Register(Spec("two", 2)).ok());
  const std::shared_ptr<Job> job = *manager_->Find("two");
  const uint64_t booked = ledger_.total();
  bool created = true;
  // Another token: PermissionDenied, the job keeps its token.
  absl::StatusOr<std::shared_ptr<Job>> s = Register(Spec("two", 2), kOther, &created);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.status().message(), HasSubstr("another token"));
  EXPECT_FALSE(created);
  EXPECT_TRUE(job->token().Matches(kOwner));
  // Another spec: FailedPrecondition naming the difference.
  v1::JobSpec changed = Spec("two", 2);
  changed.set_world_size(3);
  s = Register(changed, kOwner, &created);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.status().message(), HasSubstr("world_size"));
  // Another daemon index of the same spec.
  s = Register(Spec("two", 2), kOwner, &created, false, 1);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.status().message(), HasSubstr("daemon_index"));
  EXPECT_FALSE(created);
  EXPECT_EQ(*manager_->Find("two"), job);
  EXPECT_EQ(ledger_.total(), booked);
  EXPECT_EQ(manager_->size(), 1u);
}

TEST_F(JobManagerTest, BadRequestsCreateNothing) {
  // An index past spec.daemons.
  absl::StatusOr<std::shared_ptr<Job>> s = Register(Spec("a", 2), kOwner, nullptr, false, 2);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("daemon_index"));
  // A spec the validator refuses.
  v1::JobSpec bad = Spec("a");
  bad.set_stage(0);
  s = Register(bad);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("stage"));
  EXPECT_EQ(manager_->size(), 0u);
  EXPECT_EQ(ledger_.total(), 0u);
}

// Without the right to create (no registration token), a new job is refused
// and nothing is booked; a registered job is found as before.
TEST_F(JobManagerTest, WithoutTheRightToCreateOnlyRegisteredJobsAreFound) {
  absl::StatusOr<std::shared_ptr<Job>> refused =
      Register(Spec("a"), kOwner, nullptr, false, 0, /*may_create=*/false);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(refused.status().message(), HasSubstr("registration token"));
  EXPECT_EQ(ledger_.total(), 0u);
  EXPECT_EQ(manager_->size(), 0u);
  std::shared_ptr<Job> created = *Register(Spec("a"));
  EXPECT_EQ(Register(Spec("a"), kOwner, nullptr, false, 0, false).value_or(nullptr), created);
}

TEST_F(JobManagerTest, DrainingRefusesNewJobsOnly) {
  ASSERT_TRUE(Register(Spec("old")).ok());
  bool created = true;
  absl::StatusOr<std::shared_ptr<Job>> s = Register(Spec("new"), kOwner, &created, true);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.status().message(), HasSubstr("draining"));
  EXPECT_FALSE(created);
  EXPECT_EQ(manager_->Find("new").status().code(), absl::StatusCode::kNotFound);
  // A registered job's ranks may still register it (idempotent).
  s = Register(Spec("old"), kOwner, &created, true);
  EXPECT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(created);
}

TEST_F(JobManagerTest, MaxJobsBoundsRegistrationsUntilOneIsRemoved) {
  JobManager::Options o;
  o.max_jobs = 2;
  o.read_lease = absl::ZeroDuration();
  Make(o);
  ASSERT_TRUE(Register(Spec("a")).ok());
  ASSERT_TRUE(Register(Spec("b")).ok());
  const uint64_t booked = ledger_.total();
  absl::StatusOr<std::shared_ptr<Job>> c = Register(Spec("c"));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(c.status().message(), HasSubstr("--max_jobs"));
  EXPECT_EQ(ledger_.total(), booked);
  // Registering one of the registered jobs again is not a new job.
  EXPECT_TRUE(Register(Spec("a")).ok());
  manager_->Remove(*manager_->Find("a"));
  c = Register(Spec("c"));
  EXPECT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(manager_->size(), 2u);
}

// A manager whose ledger takes `booking` for every change it books, so
// that concurrent registrations overlap one another's creation (which
// books with no manager lock held).
struct SlowBookingManager {
  SlowBookingManager(JobManager::Options o, ShardOptimizer* optimizer, DaemonMetrics* metrics,
                     absl::Duration booking) {
    ledger.SetListener([booking](const std::string&, MemoryCategory, uint64_t) {
      absl::SleepFor(booking);
    });
    JobResources r;
    r.ledger = &ledger;
    r.optimizer = optimizer;
    manager = std::make_unique<JobManager>(o, r, metrics);
  }
  MemoryLedger ledger{0};
  std::unique_ptr<JobManager> manager;
};

// Registrations of distinct ids racing for the last places: exactly
// max_jobs of them get one (jobs still being created count).
TEST_F(JobManagerTest, ConcurrentRegistrationsDoNotPassMaxJobsTogether) {
  JobManager::Options o;
  o.max_jobs = 3;
  SlowBookingManager slow(o, optimizer_.get(), &metrics_, absl::Milliseconds(20));
  constexpr int kThreads = 12;
  std::atomic<int> ok{0}, exhausted{0}, other{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      bool created = false;
      absl::StatusOr<std::shared_ptr<Job>> s =
          slow.manager->Register(Request(Spec(absl::StrCat("job", t))), kOwner, false, JobManager::Registrant(),
                                 &created);
      if (s.ok()) {
        ++ok;
      } else if (s.status().code() == absl::StatusCode::kResourceExhausted) {
        ++exhausted;
      } else {
        ++other;
      }
    });
  }
  go = true;
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), 3);
  EXPECT_EQ(exhausted.load(), kThreads - 3);
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ(slow.manager->size(), 3u);
}

// Many ranks register the same new job at once: one creates it (its memory
// booked once), every other waits for it and gets that same job.
TEST_F(JobManagerTest, ConcurrentRegistrationsOfOneIdCreateItOnce) {
  // One job's bytes: the same spec under another id, on the fixture's ledger.
  ASSERT_TRUE(Register(Spec("reference")).ok());
  const uint64_t one_job = ledger_.total();
  ASSERT_GT(one_job, 0u);
  SlowBookingManager slow(JobManager::Options(), optimizer_.get(), &metrics_,
                          absl::Milliseconds(20));
  constexpr int kThreads = 16;
  std::vector<std::shared_ptr<Job>> got(kThreads);
  std::vector<int> created(kThreads, 0);
  std::atomic<int> errors{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      bool c = false;
      absl::StatusOr<std::shared_ptr<Job>> s =
          slow.manager->Register(Request(Spec("same")), kOwner, false, JobManager::Registrant(), &c);
      if (!s.ok()) {
        ++errors;
        return;
      }
      got[t] = *s;
      created[t] = c ? 1 : 0;
    });
  }
  go = true;
  for (auto& th : threads) th.join();
  EXPECT_EQ(errors.load(), 0);
  int creators = 0;
  for (int t = 0; t < kThreads; ++t) {
    creators += created[t];
    EXPECT_EQ(got[t], got[0]) << "thread " << t << " got another job";
  }
  EXPECT_EQ(creators, 1);
  EXPECT_EQ(slow.ledger.total(), one_job) << "the job's memory was booked more than once";
  EXPECT_EQ(slow.manager->size(), 1u);
  EXPECT_EQ(slow.manager->Find("same").value_or(nullptr), got[0]);
}

// A job that does not fit the ledger is refused whole, and a later attempt
// of the same id is answered at once (not left waiting for a creation that
// ended).
TEST(JobManagerLimitTest, AJobThatDoesNotFitLeavesNothingBehind) {
  MemoryLedger ledger(1024);
  prometheus::Registry registry;
  DaemonMetrics metrics(&registry, &ledger, "test");
  std::unique_ptr<ShardOptimizer> optimizer = *ShardOptimizer::Create(ShardOptimizer::Options());
  JobResources r;
  r.ledger = &ledger;
  r.optimizer = optimizer.get();
  JobManager m(JobManager::Options(), r, &metrics);
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool created = true;
    const absl::Time t0 = absl::Now();
    absl::StatusOr<std::shared_ptr<Job>> s =
        m.Register(Request(Spec("big")), kOwner, false, JobManager::Registrant(), &created);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted) << s.status();
    EXPECT_FALSE(created);
    EXPECT_LT(absl::Now() - t0, absl::Seconds(10)) << "attempt " << attempt;
  }
  EXPECT_EQ(m.size(), 0u);
  EXPECT_EQ(ledger.total(), 0u);
}

TEST_F(JobManagerTest, RemoveRetiresThenTickFreesTheMemory) {
  JobManager::Options o;
  o.read_lease = absl::Hours(1);
  o.janitor_period = absl::Hours(1);
  Make(o);
  ASSERT_TRUE(Register(Spec("a")).ok());
  std::shared_ptr<Job> job = *manager_->Find("a");
  const uint64_t booked = ledger_.total();
  // NoteRemoteAccess starts the read lease: a peer may be reading now.
  job->NoteRemoteAccess();
  manager_->Remove(job);
  EXPECT_EQ(manager_->Find("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(manager_->size(), 0u);
  EXPECT_THAT(manager_->All(), ::testing::IsEmpty());
  EXPECT_EQ(manager_->retired(), 1u);
  job.reset();
  manager_->Tick();
  // Within the lease: still retired, its memory still held.
  EXPECT_EQ(manager_->retired(), 1u);
  EXPECT_EQ(ledger_.total(), booked);

  // With no lease the next pass frees it and the ledger forgets the job.
  o.read_lease = absl::ZeroDuration();
  Make(o);  // the old manager frees its retired job
  EXPECT_EQ(ledger_.total(), 0u);
  ASSERT_TRUE(Register(Spec("a")).ok());
  manager_->Remove(*manager_->Find("a"));
  EXPECT_EQ(manager_->retired(), 1u);
  EXPECT_GT(ledger_.total(), 0u);
  manager_->Tick();
  EXPECT_EQ(manager_->retired(), 0u);
  EXPECT_EQ(ledger_.total(), 0u);
  EXPECT_EQ(ledger_.Snapshot().count("a"), 0u);
}

TEST_F(JobManagerTest, TheJanitorReapsWithoutBeingAsked) {
  JobManager::Options o;
  o.read_lease = absl::ZeroDuration();
  o.janitor_period = absl::Milliseconds(10);
  Make(o);
  ASSERT_TRUE(Register(Spec("a")).ok());
  manager_->Remove(*manager_->Find("a"));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (manager_->retired() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(manager_->retired(), 0u);
  EXPECT_EQ(ledger_.total(), 0u);
}

// An RPC in flight holds its job: reaping waits until the RPC lets go, then
// frees the memory, the ledger entry and the metric series together (not an
// empty ledger entry and a series left behind for good).
TEST_F(JobManagerTest, AJobHeldByACallerIsReapedWhenReleased) {
  JobManager::Options o;
  o.read_lease = absl::ZeroDuration();
  o.janitor_period = absl::Hours(1);
  Make(o);
  ASSERT_TRUE(Register(Spec("a")).ok());
  std::shared_ptr<Job> held = *manager_->Find("a");
  const uint64_t booked = ledger_.total();
  manager_->Remove(held);
  manager_->Tick();
  EXPECT_EQ(manager_->retired(), 1u) << "reaped while an RPC holds it";
  EXPECT_EQ(ledger_.total(), booked);
  EXPECT_EQ(held->config().job_id, "a");
  held.reset();
  manager_->Tick();
  EXPECT_EQ(manager_->retired(), 0u);
  EXPECT_EQ(ledger_.total(), 0u);
  EXPECT_EQ(ledger_.Snapshot().count("a"), 0u) << "the ledger kept an empty entry for the job";
}

// Rank 0 of `job` joins as incarnation 1.
absl::Status JoinRank0(const std::shared_ptr<Job>& job) {
  JoinRequest join;
  join.rank = 0;
  join.incarnation = 1;
  join.layout_fingerprint = job->config().layout.fingerprint();
  join.stage = job->config().stage;
  join.world_size = job->config().world_size;
  join.precision = DTypeToProto(job->config().precision);
  return job->Join(join).status();
}

// A registration nobody follows up with a join is removed after
// join_timeout, with every copy, its memory and its place under max_jobs; a
// job a rank joined stays however old it is.
TEST_F(JobManagerTest, AJobNoRankJoinsIsRemovedAfterTheJoinTimeout) {
  JobManager::Options o;
  o.read_lease = absl::ZeroDuration();
  o.janitor_period = absl::Hours(1);
  o.join_timeout = absl::Milliseconds(200);
  o.max_jobs = 3;
  Make(o);
  ASSERT_TRUE(Register(Spec("idle")).ok());
  ASSERT_TRUE(Register(Spec("replicated", 2, 2)).ok());
  std::shared_ptr<Job> used = *Register(Spec("used"));
  ASSERT_TRUE(JoinRank0(used).ok());
  used.reset();
  EXPECT_EQ(Register(Spec("fourth")).status().code(), absl::StatusCode::kResourceExhausted);
  manager_->Tick();
  EXPECT_EQ(manager_->size(), 3u) << "removed before the join timeout";
  absl::SleepFor(absl::Milliseconds(250));
  manager_->Tick();
  EXPECT_EQ(manager_->unjoined_removed(), 2u);
  EXPECT_FALSE(manager_->Find("idle").ok());
  EXPECT_FALSE(manager_->Find("replicated").ok());
  EXPECT_FALSE(manager_->Find("replicated", 1).ok()) << "the backup copy stayed";
  EXPECT_TRUE(manager_->Find("used").ok());
  EXPECT_EQ(ledger_.Snapshot().count("idle"), 0u);
  EXPECT_TRUE(Register(Spec("fourth")).ok()) << "the removed jobs still count against max_jobs";
}

// A job whose ranks all fell silent is removed after job_idle_timeout with
// every copy; one whose ranks are heard from stays.
TEST_F(JobManagerTest, AJobNoRankIsHeardFromIsRemovedAfterTheIdleTimeout) {
  JobManager::Options o;
  o.read_lease = absl::ZeroDuration();
  o.janitor_period = absl::Hours(1);
  o.job_idle_timeout = absl::Milliseconds(300);
  Make(o);
  std::shared_ptr<Job> crashed = *Register(Spec("crashed", 2, 2));
  std::shared_ptr<Job> alive = *Register(Spec("alive"));
  ASSERT_TRUE(JoinRank0(crashed).ok());
  ASSERT_TRUE(JoinRank0(alive).ok());
  crashed.reset();
  manager_->Tick();
  EXPECT_EQ(manager_->size(), 2u) << "removed before the idle timeout";
  // "alive" is heard from every 100 ms (as a heartbeat does); "crashed" not.
  for (int i = 0; i < 4; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    ASSERT_TRUE(alive->CheckRank(0, 1, "").ok());
  }
  manager_->Tick();
  EXPECT_EQ(manager_->idle_removed(), 1u);
  EXPECT_FALSE(manager_->Find("crashed").ok());
  EXPECT_FALSE(manager_->Find("crashed", 1).ok()) << "the backup copy stayed";
  EXPECT_TRUE(manager_->Find("alive").ok());
  EXPECT_EQ(manager_->unjoined_removed(), 0u);
}

// Before an idle job goes, the hook (the daemon's save) runs for each of its
// primary copies, not its backups; a job a rank was heard from while the
// hook ran (a restarted rank's first call) stays.
TEST_F(JobManagerTest, BeforeIdleRemovalSeesPrimariesAndARankHeardMeanwhileKeepsTheJob) {
  JobManager::Options o;
  o.read_lease = absl::ZeroDuration();
  o.janitor_period = absl::Hours(1);
  o.job_idle_timeout = absl::Milliseconds(300);
  std::vector<std::string> seen;
  // "later" is not ready at the first pass (its save still writes).
  int later_asked = 0;
  o.before_idle_removal = [&](const std::shared_ptr<Job>& job) {
    seen.push_back(absl::StrCat(job->config().job_id, "/", job->daemon_index()));
    if (job->config().job_id == "back") EXPECT_TRUE(job->CheckRank(0, 1, "").ok());
    if (job->config().job_id == "later") return ++later_asked > 1;
    return true;
  };
  Make(o);
  std::shared_ptr<Job> gone = *Register(Spec("gone", 2, 2));  // and the backup of group 1
  std::shared_ptr<Job> back = *Register(Spec("back"));
  std::shared_ptr<Job> later = *Register(Spec("later"));
  ASSERT_TRUE(JoinRank0(gone).ok());
  ASSERT_TRUE(JoinRank0(back).ok());
  ASSERT_TRUE(JoinRank0(later).ok());
  gone.reset();
  back.reset();
  later.reset();
  absl::SleepFor(absl::Milliseconds(400));
  manager_->Tick();
  EXPECT_EQ(seen, (std::vector<std::string>{"back/0", "gone/0", "later/0"}));
  EXPECT_EQ(manager_->idle_removed(), 1u);
  EXPECT_FALSE(manager_->Find("gone").ok());
  EXPECT_FALSE(manager_->Find("gone", 1).ok());
  EXPECT_TRUE(manager_->Find("back").ok()) << "a job heard from during the hook was removed";
  EXPECT_TRUE(manager_->Find("later").ok()) << "removed before the hook was ready";
  manager_->Tick();
  EXPECT_FALSE(manager_->Find("later").ok());
  EXPECT_EQ(manager_->idle_removed(), 2u);
}

// Removing a copy that is no longer registered retires nothing a second time.
TEST_F(JobManagerTest, RemoveTwiceRetiresOnce) {
  JobManager::Options o;
  o.janitor_period = absl::Hours(1);
  Make(o);
  ASSERT_TRUE(Register(Spec("a")).ok());
  std::shared_ptr<Job> job = *manager_->Find("a");
  manager_->Remove(job);
  manager_->Remove(job);
  EXPECT_EQ(manager_->retired(), 1u);
}

TEST_F(JobManagerTest, OnRemoveRunsOnceBeforeTheIdIsFree) {
  JobManager::Options o;
  o.read_lease = absl::ZeroDuration();
  std::vector<std::string> removed;
  bool still_registered = false;
  JobManager* manager = nullptr;
  o.on_remove = [&](const std::shared_ptr<Job>& job) {
    removed.push_back(job->config().job_id);
    absl::StatusOr<std::shared_ptr<Job>> found = manager->Find(job->config().job_id);
    still_registered = found.ok() && *found == job;
  };
  Make(o);
  manager = manager_.get();
  ASSERT_TRUE(Register(Spec("a")).ok());
  const std::shared_ptr<Job> first = *manager_->Find("a");
  manager_->Remove(first);
  EXPECT_THAT(removed, ::testing::ElementsAre("a"));
  EXPECT_TRUE(still_registered) << "on_remove ran after the id was freed";
  // A stale copy: the id was registered again since. Removing the old
  // object again neither removes the new job nor calls on_remove.
  ASSERT_TRUE(Register(Spec("a")).ok());
  const std::shared_ptr<Job> second = *manager_->Find("a");
  ASSERT_NE(second, first);
  manager_->Remove(first);
  EXPECT_EQ(manager_->Find("a").value_or(nullptr), second);
  EXPECT_THAT(removed, ::testing::ElementsAre("a"));
}

// replicas = 2: the home group as primary and the group before it as its
// backup, one id; removal of one copy leaves the other, and the id is not
// registered again until both are gone.
TEST_F(JobManagerTest, AReplicatedJobHasTwoCopies) {
  JobManager::Options o;
  o.read_lease = absl::ZeroDuration();
  int on_remove = 0;
  o.on_remove = [&](const std::shared_ptr<Job>&) { ++on_remove; };
  Make(o);
  const v1::JobSpec spec = Spec("r", 3, 2);
  ASSERT_TRUE(Register(spec, kOwner, nullptr, false, 1).ok());
  std::shared_ptr<Job> home = *manager_->Find("r");
  EXPECT_EQ(home->daemon_index(), 1u);
  EXPECT_EQ(home->role(), ReplicaRole::kPrimary);
  absl::StatusOr<std::shared_ptr<Job>> backup = manager_->Find("r", BackedUpGroup(1, 3));
  ASSERT_TRUE(backup.ok()) << backup.status();
  EXPECT_EQ((*backup)->daemon_index(), 0u);
  EXPECT_EQ((*backup)->role(), ReplicaRole::kBackup);
  EXPECT_TRUE((*backup)->token().Matches(kOwner));
  EXPECT_EQ(manager_->Find("r", 2).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(manager_->size(), 1u);
  EXPECT_EQ(manager_->All().size(), 2u);
  EXPECT_GT(ledger_.JobBytes("r")[static_cast<int>(MemoryCategory::kReplica)], 0u);

  manager_->Remove(home);
  EXPECT_EQ(on_remove, 0) << "the backup copy is still registered";
  EXPECT_EQ(manager_->Find("r").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(manager_->Find("r", 0).ok());
  absl::StatusOr<std::shared_ptr<Job>> again = Register(spec, kOwner, nullptr, false, 1);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(again.status().message(), HasSubstr("being removed"));
  manager_->Remove(*backup);
  EXPECT_EQ(on_remove, 1);
  EXPECT_EQ(manager_->size(), 0u);
  home.reset();
  backup = nullptr;
  manager_->Tick();
  EXPECT_EQ(ledger_.total(), 0u);
  EXPECT_TRUE(Register(spec, kOwner, nullptr, false, 1).ok());
}

TEST_F(JobManagerTest, DestructionFreesEveryJob) {
  ASSERT_TRUE(Register(Spec("a")).ok());
  ASSERT_TRUE(Register(Spec("b")).ok());
  manager_->Remove(*manager_->Find("b"));  // retired, not yet reaped
  EXPECT_GT(ledger_.total(), 0u);
  manager_.reset();
  EXPECT_EQ(ledger_.total(), 0u);
}

}  // namespace
}  // namespace zeroshard
