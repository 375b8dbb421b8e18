// ServiceContext's authority checks (docs/security.md) on their own: a
// grpc::ServerContext carrying the metadata a caller would send, a
// JobManager with a plain and a replicated job, and the code each check
// answers for no token, a malformed one, another job's, the job's own and
// the admin's.

#include <filesystem>
#include <memory>
#include <ostream>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "common/channel.h"
#include "common/checkpoint_files.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/test/server_context_test_spouse.h"
#include "gtest/gtest.h"
#include "metrics/metric_names.h"
#include "metrics/registry.h"
#include "prometheus/registry.h"
#include "server/job/job_manager.h"
#include "server/ledger/memory_ledger.h"
#include "server/metrics/daemon_metrics.h"
#include "server/optimizer/optimizer.h"
#include "server/rpc/services.h"

namespace zeroshard {

// Failure messages name the job copy instead of dumping its bytes.
void PrintTo(const Job& job, std::ostream* os) {
  *os << "job " << job.config().job_id << " group " << job.daemon_index() << " at " << &job;
}

namespace {

using ::testing::HasSubstr;

constexpr char kJobToken[] = "the-job-token-0123456789";
constexpr char kOtherToken[] = "another-jobs-token-0123456789";
constexpr char kAdminToken[] = "the-admin-token-0123456789";

v1::JobSpec Spec(const std::string& id, uint32_t replicas) {
  JobSettings s;
  s.job_id = id;
  s.world_size = 2;
  s.precision = DType::kFp32;
  s.replicas = replicas;
  s.daemons = {"127.0.0.1:7001", "127.0.0.1:7002"};
  return ToJobSpec(s, *Layout::Create({{"w", {300}, DType::kFp32, 0}}));
}

// A server-side call context whose client sent `metadata`.
class Call {
 public:
  explicit Call(std::initializer_list<std::pair<std::string, std::string>> metadata = {})
      : spouse_(&context_) {
    for (const auto& [key, value] : metadata) spouse_.AddClientMetadata(key, value);
  }
  // A call carrying "authorization: Bearer <token>".
  static std::unique_ptr<Call> WithToken(const std::string& token) {
    return std::make_unique<Call>(
        std::initializer_list<std::pair<std::string, std::string>>{
            {kAuthorizationMetadataKey, absl::StrCat(kBearerPrefix, token)}});
  }
  const grpc::ServerContext& operator*() const { return context_; }

 private:
  grpc::ServerContext context_;
  grpc::testing::ServerContextTestSpouse spouse_;
};

class ServiceContextTest : public ::testing::Test {
 protected:
  ServiceContextTest() : ledger_(0), metrics_(&registry_, &ledger_, "test") {}

  void SetUp() override {
    optimizer_ = *ShardOptimizer::Create(ShardOptimizer::Options());
    JobResources r;
    r.ledger = &ledger_;
    r.optimizer = optimizer_.get();
    jobs_ = std::make_unique<JobManager>(JobManager::Options(), r, &metrics_);
    ctx_.jobs = jobs_.get();
    ctx_.ledger = &ledger_;
    ctx_.metrics = &metrics_;
    ctx_.admin = TokenDigest::Of(kAdminToken);
    bool created = false;
    v1::RegisterJobRequest plain;
    *plain.mutable_spec() = Spec("victim", 1);
    job_ = *jobs_->Register(plain, TokenDigest::Of(kJobToken), false, JobManager::Registrant(), &created);
    // Replicated, home group 0 (primary), backing up group 1.
    v1::RegisterJobRequest replicated;
    *replicated.mutable_spec() = Spec("pair", 2);
    pair_ = *jobs_->Register(replicated, TokenDigest::Of(kJobToken), false, JobManager::Registrant(), &created);
    pair_backup_ = *jobs_->Find("pair", 1);
    epoch_ = pair_->ReplicaState()->epoch;
  }

  MemoryLedger ledger_;
  prometheus::Registry registry_;
  DaemonMetrics metrics_;
  std::unique_ptr<ShardOptimizer> optimizer_;
  std::unique_ptr<JobManager> jobs_;
  ServiceContext ctx_;
  std::shared_ptr<Job> job_, pair_, pair_backup_;
  uint64_t epoch_ = 0;
};

TEST_F(ServiceContextTest, FindJobOpensWithTheJobsTokenOrTheAdmins) {
  for (const char* token : {kJobToken, kAdminToken}) {
    absl::StatusOr<std::shared_ptr<Job>> found = ctx_.FindJob(**Call::WithToken(token), "victim");
    ASSERT_TRUE(found.ok()) << token << ": " << found.status();
    EXPECT_EQ(*found, job_);
  }
}

TEST_F(ServiceContextTest, FindJobWithoutAUsableTokenIsUnauthenticated) {
  absl::Status s = ctx_.FindJob(*Call(), "victim").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  EXPECT_THAT(s.message(), HasSubstr("job victim needs a token"));
  // Not a bearer token.
  s = ctx_.FindJob(*Call({{kAuthorizationMetadataKey, absl::StrCat("Basic ", kJobToken)}}),
                   "victim")
          .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  EXPECT_THAT(s.message(), HasSubstr("needs a token"));
  // A bearer value that is no well-formed token (too short).
  s = ctx_.FindJob(**Call::WithToken("short"), "victim").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  EXPECT_THAT(s.message(), HasSubstr("bearer token"));
  // Asked before the job is looked up: no token learns nothing about ids.
  EXPECT_EQ(ctx_.FindJob(*Call(), "no-such-job").status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST_F(ServiceContextTest, FindJobWithAnotherTokenIsPermissionDenied) {
  const absl::Status s = ctx_.FindJob(**Call::WithToken(kOtherToken), "victim").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("does not open job victim"));
  // Without an admin token configured, the admin's old token is just
  // another token.
  ctx_.admin.reset();
  EXPECT_EQ(ctx_.FindJob(**Call::WithToken(kAdminToken), "victim").status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(ctx_.FindJob(**Call::WithToken(kJobToken), "victim").ok());
}

TEST_F(ServiceContextTest, AnUnknownJobIsNotFoundForAnyToken) {
  for (const char* token : {kJobToken, kOtherToken, kAdminToken}) {
    const absl::Status s = ctx_.FindJob(**Call::WithToken(token), "no-such-job").status();
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << token << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("no-such-job"));
  }
}

// Calls naming a replica group (common/channel.h metadata) reach that
// group's copy, which must be serving at the call's epoch.
TEST_F(ServiceContextTest, FindJobRoutesReplicaCallsToTheServingCopy) {
  auto call = [&](const std::string& token, uint32_t group, uint64_t epoch) {
    return std::make_unique<Call>(std::initializer_list<std::pair<std::string, std::string>>{
        {kAuthorizationMetadataKey, absl::StrCat(kBearerPrefix, token)},
        {kReplicaGroupMetadataKey, absl::StrCat(group)},
        {kReplicaEpochMetadataKey, absl::StrCat(epoch)}});
  };
  absl::StatusOr<std::shared_ptr<Job>> home = ctx_.FindJob(**call(kJobToken, 0, epoch_), "pair");
  ASSERT_TRUE(home.ok()) << home.status();
  EXPECT_EQ(*home, pair_);
  // Another epoch: refused, saying so.
  absl::Status s = ctx_.FindJob(**call(kJobToken, 0, epoch_ + 1), "pair").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("epoch"));
  // The backup copy held here does not serve its group's requests...
  s = ctx_.FindJob(**call(kJobToken, 1, epoch_), "pair").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("backup"));
  // ...but is read (serving = false).
  EXPECT_EQ(ctx_.FindJob(**call(kJobToken, 1, epoch_), "pair", false).value_or(nullptr),
            pair_backup_);
  // A group not held here.
  EXPECT_EQ(ctx_.FindJob(**call(kJobToken, 5, epoch_), "pair").status().code(),
            absl::StatusCode::kNotFound);
  // The token is checked whatever the group.
  EXPECT_EQ(ctx_.FindJob(**call(kOtherToken, 0, epoch_), "pair").status().code(),
            absl::StatusCode::kPermissionDenied);
  // Malformed metadata: one key without the other.
  s = ctx_.FindJob(*Call({{kAuthorizationMetadataKey, absl::StrCat(kBearerPrefix, kJobToken)},
                          {kReplicaGroupMetadataKey, "0"}}),
                   "pair")
          .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

TEST_F(ServiceContextTest, FindCopyReachesEitherRoleWithTheSameTokenCheck) {
  EXPECT_EQ(ctx_.FindCopy(**Call::WithToken(kJobToken), "pair", 1).value_or(nullptr),
            pair_backup_);
  EXPECT_EQ(ctx_.FindCopy(**Call::WithToken(kAdminToken), "pair", 0).value_or(nullptr), pair_);
  EXPECT_EQ(ctx_.FindCopy(**Call::WithToken(kOtherToken), "pair", 1).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ctx_.FindCopy(*Call(), "pair", 1).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(ctx_.FindCopy(**Call::WithToken(kJobToken), "pair", 7).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ctx_.FindCopy(**Call::WithToken(kJobToken), "victim", 1).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ServiceContextTest, RequireAdminTakesOnlyTheAdminToken) {
  EXPECT_TRUE(ctx_.RequireAdmin(**Call::WithToken(kAdminToken)).ok());
  absl::Status s = ctx_.RequireAdmin(*Call());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  EXPECT_THAT(s.message(), HasSubstr("needs a token"));
  for (const char* token : {kJobToken, kOtherToken}) {
    s = ctx_.RequireAdmin(**Call::WithToken(token));
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << token << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("admin token"));
  }
  // A daemon without an admin token: nobody is the admin.
  ctx_.admin.reset();
  s = ctx_.RequireAdmin(**Call::WithToken(kAdminToken));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("has none"));
  EXPECT_EQ(ctx_.RequireAdmin(*Call()).code(), absl::StatusCode::kUnauthenticated);
}

// With a registration token, creating a job takes that token (as its own
// metadata) or the admin's bearer token; without one, anyone may.
TEST_F(ServiceContextTest, MayCreateJobsTakesTheRegistrationTokenOrTheAdmins) {
  const TokenDigest job = TokenDigest::Of(kJobToken);
  EXPECT_TRUE(ctx_.MayCreateJobs(*Call(), job)) << "no registration token: open";
  constexpr char kRegistration[] = "the-registration-token-0123";
  ctx_.registration = TokenDigest::Of(kRegistration);
  EXPECT_FALSE(ctx_.MayCreateJobs(*Call(), job));
  EXPECT_FALSE(ctx_.MayCreateJobs(*Call({{kRegistrationMetadataKey, kOtherToken}}), job));
  EXPECT_FALSE(ctx_.MayCreateJobs(*Call({{kRegistrationMetadataKey, ""}}), job));
  EXPECT_TRUE(ctx_.MayCreateJobs(*Call({{kRegistrationMetadataKey, kRegistration}}), job));
  EXPECT_TRUE(ctx_.MayCreateJobs(*Call(), TokenDigest::Of(kAdminToken)));
  ctx_.admin.reset();
  EXPECT_FALSE(ctx_.MayCreateJobs(*Call(), TokenDigest::Of(kAdminToken)));
}

// The identity a registration's quotas count against: the admin (exempt),
// the holders of the registration token together, or every anonymous
// caller together (certificates: security_test's TlsDaemonTest.RegistrationsCountPerCertificate).
TEST_F(ServiceContextTest, RegistrantIsTheAdminTheRegistrationTokenOrAnonymous) {
  const TokenDigest job = TokenDigest::Of(kJobToken);
  JobManager::Registrant r = ctx_.RegistrantOf(*Call(), job);
  EXPECT_TRUE(r.may_create);
  EXPECT_EQ(r.identity, "anonymous");
  EXPECT_FALSE(r.exempt);
  r = ctx_.RegistrantOf(*Call(), TokenDigest::Of(kAdminToken));
  EXPECT_EQ(r.identity, "admin");
  EXPECT_TRUE(r.exempt);
  constexpr char kRegistration[] = "the-registration-token-0123";
  ctx_.registration = TokenDigest::Of(kRegistration);
  r = ctx_.RegistrantOf(*Call({{kRegistrationMetadataKey, kRegistration}}), job);
  EXPECT_TRUE(r.may_create);
  EXPECT_EQ(r.identity, "registration token");
  EXPECT_FALSE(r.exempt);
  r = ctx_.RegistrantOf(*Call(), job);
  EXPECT_FALSE(r.may_create);
  EXPECT_FALSE(r.exempt);
}

TEST_F(ServiceContextTest, MayOpenIsTheJobsTokenOrTheAdmins) {
  EXPECT_TRUE(ctx_.MayOpen(**Call::WithToken(kJobToken), *job_));
  EXPECT_TRUE(ctx_.MayOpen(**Call::WithToken(kAdminToken), *job_));
  EXPECT_FALSE(ctx_.MayOpen(**Call::WithToken(kOtherToken), *job_));
  EXPECT_FALSE(ctx_.MayOpen(*Call(), *job_));
  ctx_.admin.reset();
  EXPECT_FALSE(ctx_.MayOpen(**Call::WithToken(kAdminToken), *job_));
}

// Without a checkpoint directory: the registered job's token or the admin.
TEST_F(ServiceContextTest, JobFilesOpenWithTheRegisteredJobsToken) {
  EXPECT_TRUE(ctx_.AuthorizeJobFiles(**Call::WithToken(kJobToken), "victim").ok());
  EXPECT_TRUE(ctx_.AuthorizeJobFiles(**Call::WithToken(kAdminToken), "gone").ok());
  EXPECT_EQ(ctx_.AuthorizeJobFiles(**Call::WithToken(kOtherToken), "victim").code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ctx_.AuthorizeJobFiles(**Call::WithToken(kJobToken), "gone").code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ctx_.AuthorizeJobFiles(*Call(), "victim").code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(ctx_.CheckFilesOwner("victim", TokenDigest::Of(kOtherToken)).ok())
      << "no checkpoint directory: no owner to check";
}

// With a checkpoint directory: files belong to the token of the job that
// first saved them, registered or not.
TEST_F(ServiceContextTest, JobFilesBelongToTheTokenThatClaimedThem) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/service_context_files");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  ctx_.checkpoint_dir = dir;
  // Nothing claimed yet: the registered job's token, not another.
  EXPECT_TRUE(ctx_.CheckFilesOwner("victim", TokenDigest::Of(kOtherToken)).ok());
  EXPECT_TRUE(ctx_.AuthorizeJobFiles(**Call::WithToken(kJobToken), "victim").ok());
  EXPECT_EQ(ctx_.AuthorizeJobFiles(**Call::WithToken(kOtherToken), "victim").code(),
            absl::StatusCode::kPermissionDenied);

  ASSERT_TRUE(ctx_.ClaimFiles(*job_).ok());
  EXPECT_EQ(*ReadCheckpointOwner(dir, "victim"), job_->token().ToHex());
  EXPECT_TRUE(ctx_.ClaimFiles(*job_).ok()) << "claimed again by its owner";
  EXPECT_TRUE(ctx_.CheckFilesOwner("victim", TokenDigest::Of(kJobToken)).ok());
  EXPECT_TRUE(ctx_.CheckFilesOwner("victim", TokenDigest::Of(kAdminToken)).ok());
  absl::Status s = ctx_.CheckFilesOwner("victim", TokenDigest::Of(kOtherToken));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("another job token"));

  // The job ends; its token still opens its files, another does not.
  jobs_->Remove(job_);
  EXPECT_TRUE(ctx_.AuthorizeJobFiles(**Call::WithToken(kJobToken), "victim").ok());
  EXPECT_EQ(ctx_.AuthorizeJobFiles(**Call::WithToken(kOtherToken), "victim").code(),
            absl::StatusCode::kPermissionDenied);
  // A job of the same id under another token cannot save beside them.
  bool created = false;
  v1::RegisterJobRequest again;
  *again.mutable_spec() = Spec("victim", 1);
  absl::StatusOr<std::shared_ptr<Job>> taken =
      jobs_->Register(again, TokenDigest::Of(kOtherToken), false, JobManager::Registrant(), &created);
  ASSERT_TRUE(taken.ok()) << taken.status();
  s = ctx_.ClaimFiles(**taken);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_EQ(*ReadCheckpointOwner(dir, "victim"), job_->token().ToHex()) << "owner unchanged";
  std::filesystem::remove_all(dir);
}

TEST_F(ServiceContextTest, DoneCountsAndKeepsTheCode) {
  auto count = [&](const char* code) {
    return metrics::SumOf(registry_.Collect(), metrics::kRequestsTotal.name,
                          {{"rpc", "TestRpc"}, {"code", code}});
  };
  const grpc::Status ok = ctx_.Done("TestRpc", absl::OkStatus());
  EXPECT_TRUE(ok.ok());
  const grpc::Status denied = ctx_.Done("TestRpc", absl::PermissionDeniedError("no"));
  EXPECT_EQ(denied.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(denied.error_message(), "no");
  EXPECT_EQ(ctx_.Done("TestRpc", absl::UnauthenticatedError("who")).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(count("OK"), 1.0);
  EXPECT_EQ(count("PERMISSION_DENIED"), 1.0);
  EXPECT_EQ(count("UNAUTHENTICATED"), 1.0);
}

}  // namespace
}  // namespace zeroshard
