// A peer whose process stops answering (SIGSTOP: its kernel still accepts
// and acknowledges) fails a call in flight with UNAVAILABLE through the
// keepalive pings, long before the call's own deadline; without keepalive
// the call waits out its deadline. (A call that waits for a new connection
// to a stopped peer is not on a transport yet: no ping goes out for it, and
// its own deadline ends it.)

#include "common/keepalive.h"

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"

namespace zeroshard {
namespace {

// Answers every Check with SERVING.
class HealthService final : public grpc::health::v1::Health::Service {
  grpc::Status Check(grpc::ServerContext*, const grpc::health::v1::HealthCheckRequest*,
                     grpc::health::v1::HealthCheckResponse* response) override {
    response->set_status(grpc::health::v1::HealthCheckResponse::SERVING);
    return grpc::Status::OK;
  }
  // SERVING once, then nothing until the caller leaves.
  grpc::Status Watch(grpc::ServerContext* context, const grpc::health::v1::HealthCheckRequest*,
                     grpc::ServerWriter<grpc::health::v1::HealthCheckResponse>* writer) override {
    grpc::health::v1::HealthCheckResponse response;
    response.set_status(grpc::health::v1::HealthCheckResponse::SERVING);
    writer->Write(response);
    while (!context->IsCancelled()) absl::SleepFor(absl::Milliseconds(50));
    return grpc::Status::OK;
  }
};

// A child process serving grpc.health.v1 on a loopback port; stopped and
// reaped by the destructor.
class ChildServer {
 public:
  // Runs this test binary again as the server (a fresh process: gRPC does
  // not survive a fork).
  ChildServer() {
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      execl("/proc/self/exe", "keepalive_test", "--serve_health", nullptr);
      _exit(127);
    }
    close(fds[1]);
    if (pid_ > 0 && read(fds[0], &port_, sizeof(port_)) != sizeof(port_)) port_ = 0;
    close(fds[0]);
  }
  ~ChildServer() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  int port() const { return port_; }
  // Returns once the child is stopped (state T in /proc), at most 5 s.
  bool Stop() const {
    kill(pid_, SIGSTOP);
    const std::string stat = absl::StrCat("/proc/", pid_, "/stat");
    for (int i = 0; i < 500; ++i) {
      std::ifstream in(stat);
      std::string pid, comm, state;
      in >> pid >> comm >> state;
      if (state == "T") return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
};

grpc::Status Check(grpc::health::v1::Health::Stub& stub, absl::Duration timeout) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  return stub.Check(&context, request, &response);
}

// One channel to a child server: a first call answered, then the child
// stopped and a second call made with `deadline`.
grpc::Status CallAStoppedPeer(absl::Duration liveness, absl::Duration deadline) {
  ChildServer child;
  if (child.port() == 0) return grpc::Status(grpc::StatusCode::INTERNAL, "no child server");
  grpc::ChannelArguments args;
  SetChannelKeepalive(liveness, &args);
  auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", child.port()),
                                           grpc::InsecureChannelCredentials(), args);
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::Status first = Check(*stub, absl::Seconds(10));
  if (!first.ok()) return first;
  if (!child.Stop()) return grpc::Status(grpc::StatusCode::INTERNAL, "the child did not stop");
  const absl::Time start = absl::Now();
  grpc::Status second = Check(*stub, deadline);
  std::printf("a call to the stopped peer ended after %.1f s: %s\n",
              absl::ToDoubleSeconds(absl::Now() - start), second.error_message().c_str());
  return second;
}

TEST(KeepaliveTest, ACallToAStoppedPeerFailsUnavailableBeforeItsDeadline) {
  const grpc::Status s = CallAStoppedPeer(kMinLivenessTimeout, absl::Seconds(60));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
}

// No ping goes out on an idle channel: in a process with no gRPC server (a
// trainer between steps) nothing may read a ping's answer for seconds, and
// the watchdog would close a healthy connection.
TEST(KeepaliveTest, AnIdleChannelStaysConnected) {
  ChildServer child;
  ASSERT_NE(child.port(), 0);
  grpc::ChannelArguments args;
  SetChannelKeepalive(kMinLivenessTimeout, &args);
  auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", child.port()),
                                           grpc::InsecureChannelCredentials(), args);
  auto stub = grpc::health::v1::Health::NewStub(channel);
  ASSERT_TRUE(Check(*stub, absl::Seconds(10)).ok());
  absl::SleepFor(absl::Seconds(7));  // past the backup poller's 5 s
  EXPECT_EQ(channel->GetState(false), GRPC_CHANNEL_READY);
  EXPECT_TRUE(Check(*stub, absl::Seconds(10)).ok());
}

// A call that only receives (as a Gather's stream) after several pings
// were answered: gRPC's default would send no further ping for 5 minutes.
TEST(KeepaliveTest, AReceivingCallFindsItsPeerStoppedAfterPingsWereAnswered) {
  ChildServer child;
  ASSERT_NE(child.port(), 0);
  grpc::ChannelArguments args;
  SetChannelKeepalive(kMinLivenessTimeout, &args);
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateCustomChannel(
      absl::StrCat("127.0.0.1:", child.port()), grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  grpc::health::v1::HealthCheckRequest request;
  auto reader = stub->Watch(&context, request);
  grpc::health::v1::HealthCheckResponse response;
  ASSERT_TRUE(reader->Read(&response));
  absl::SleepFor(4 * kMinKeepaliveInterval);  // pings sent and answered
  ASSERT_TRUE(child.Stop());
  const absl::Time start = absl::Now();
  EXPECT_FALSE(reader->Read(&response));
  const grpc::Status s = reader->Finish();
  std::printf("the stream from the stopped peer ended after %.1f s: %s\n",
              absl::ToDoubleSeconds(absl::Now() - start), s.error_message().c_str());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
}

TEST(KeepaliveTest, WithoutKeepaliveTheCallWaitsOutItsDeadline) {
  const grpc::Status s = CallAStoppedPeer(absl::ZeroDuration(), absl::Seconds(4));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
}

TEST(KeepaliveTest, LivenessTimeoutsAreZeroOrAtLeastTheMinimum) {
  EXPECT_TRUE(ValidateLivenessTimeout(absl::ZeroDuration(), "--x").ok());
  EXPECT_TRUE(ValidateLivenessTimeout(kDefaultLivenessTimeout, "--x").ok());
  const absl::Status s = ValidateLivenessTimeout(absl::Seconds(1), "--liveness");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--liveness"), std::string::npos) << s;
  EXPECT_FALSE(ValidateLivenessTimeout(-absl::Seconds(3), "--x").ok());
}

// The child: serves until killed, its port written to stdout first.
int ServeHealth() {
  HealthService health;
  grpc::ServerBuilder builder;
  builder.RegisterService(&health);
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  SetServerKeepalivePolicy(&builder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) port = 0;
  if (write(STDOUT_FILENO, &port, sizeof(port)) != sizeof(port) || server == nullptr) return 1;
  server->Wait();
  return 0;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--serve_health") return zeroshard::ServeHealth();
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
