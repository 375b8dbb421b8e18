// The standard probes a daemon serves for orchestrators and tools: gRPC
// health checking (grpc.health.v1.Health, SERVING until Drain) and server
// reflection (the zeroshard services listed without their .proto files).
// Neither needs a token.

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"
#include "server/testing/reflection_wire.pb.h"

namespace zeroshard {
namespace {

constexpr char kAdminToken[] = "probes-test-admin-token-0123456789";

std::unique_ptr<Daemon> StartWithAdmin() {
  DaemonOptions o;
  o.admin_token = kAdminToken;
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

void SetDeadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
}

// Health.Check on `address` without any token.
grpc::health::v1::HealthCheckResponse::ServingStatus Check(const std::string& address,
                                                           grpc::Status* status) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  grpc::health::v1::HealthCheckResponse resp;
  *status = stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp);
  return resp.status();
}

TEST(ProbesTest, HealthIsServingUntilDrain) {
  std::unique_ptr<Daemon> d = StartWithAdmin();
  ASSERT_NE(d, nullptr);
  grpc::Status status;
  EXPECT_EQ(Check(d->address(), &status), grpc::health::v1::HealthCheckResponse::SERVING);
  ASSERT_TRUE(status.ok()) << status.error_message();

  testing::DaemonClient admin(d->address(), kAdminToken);
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::DrainResponse drained;
  ASSERT_TRUE(admin.control->Drain(&ctx, v1::DrainRequest(), &drained).ok());
  EXPECT_EQ(Check(d->address(), &status), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  ASSERT_TRUE(status.ok()) << status.error_message();
}

// DaemonOptions::health_listen: a plaintext server with the health service
// only, SERVING until Drain like the main one; nothing else is served there.
TEST(ProbesTest, HealthOnlyListenerFollowsTheDaemon) {
  DaemonOptions o;
  o.admin_token = kAdminToken;
  o.health_listen = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<Daemon>> started = Daemon::Start(o);
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Daemon> d = *std::move(started);
  ASSERT_NE(d->health_port(), 0);
  const std::string probe = absl::StrCat("127.0.0.1:", d->health_port());
  grpc::Status status;
  EXPECT_EQ(Check(probe, &status), grpc::health::v1::HealthCheckResponse::SERVING);
  ASSERT_TRUE(status.ok()) << status.error_message();

  // The zeroshard services are not there.
  testing::DaemonClient on_probe(probe, kAdminToken);
  grpc::ClientContext status_ctx;
  SetDeadline(&status_ctx);
  v1::StatusResponse unused;
  EXPECT_EQ(on_probe.admin->Status(&status_ctx, v1::StatusRequest(), &unused).error_code(),
            grpc::UNIMPLEMENTED);

  testing::DaemonClient admin(d->address(), kAdminToken);
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::DrainResponse drained;
  ASSERT_TRUE(admin.control->Drain(&ctx, v1::DrainRequest(), &drained).ok());
  EXPECT_EQ(Check(probe, &status), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  ASSERT_TRUE(status.ok()) << status.error_message();

  d->Shutdown(absl::Milliseconds(100));
  Check(probe, &status);
  EXPECT_FALSE(status.ok()) << "the health-only server stops with the daemon";
}

// A health_listen that cannot be bound fails the start, naming the option.
TEST(ProbesTest, HealthListenThatCannotBindFailsTheStart) {
  DaemonOptions o;
  o.health_listen = "192.0.2.1:1";  // TEST-NET-1: not an address of this host
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("--health_listen"), std::string::npos) << d.status();
}

// One list_services exchange over a generic bidi call.
TEST(ProbesTest, ReflectionListsTheServices) {
  std::unique_ptr<Daemon> d = StartWithAdmin();
  ASSERT_NE(d, nullptr);
  auto channel = grpc::CreateChannel(d->address(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  auto next = [&cq](void* want) {
    void* tag = nullptr;
    bool ok = false;
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(tag, want);
    return ok;
  };
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  int tags[5];
  call->StartCall(&tags[0]);
  ASSERT_TRUE(next(&tags[0]));
  zeroshard::testing::ReflectionRequest request;
  request.set_list_services("*");
  std::string bytes = request.SerializeAsString();
  grpc::Slice slice(bytes);
  grpc::ByteBuffer out(&slice, 1);
  call->Write(out, &tags[1]);
  ASSERT_TRUE(next(&tags[1]));
  grpc::ByteBuffer in;
  call->Read(&in, &tags[2]);
  ASSERT_TRUE(next(&tags[2]));
  call->WritesDone(&tags[3]);
  ASSERT_TRUE(next(&tags[3]));
  grpc::Status status;
  call->Finish(&status, &tags[4]);
  ASSERT_TRUE(next(&tags[4]));
  ASSERT_TRUE(status.ok()) << status.error_message();

  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(in.Dump(&slices).ok());
  std::string reply;
  for (const grpc::Slice& s : slices)
    reply.append(reinterpret_cast<const char*>(s.begin()), s.size());
  zeroshard::testing::ReflectionResponse response;
  ASSERT_TRUE(response.ParseFromString(reply));
  EXPECT_FALSE(response.has_error_response()) << response.error_response().error_message();
  std::set<std::string> names;
  for (const auto& s : response.list_services_response().service()) names.insert(s.name());
  for (const char* want :
       {"zeroshard.v1.Control", "zeroshard.v1.Shard", "zeroshard.v1.Admin",
        "zeroshard.v1.Checkpoint", "zeroshard.v1.Activation", "grpc.health.v1.Health"}) {
    EXPECT_EQ(names.count(want), 1u) << want << " is not listed";
  }
}

// A daemon on a unix socket (--listen=unix:PATH), as the single-node Slurm
// script runs it: only in a directory of this user's closed to others, the
// socket itself mode 0600; trainers reach it at the same address (a job
// spec naming it registers, joins and answers).
TEST(ProbesTest, ServesAUnixSocketInAPrivateDirectory) {
  // In /tmp: TEST_TMPDIR's path may be longer than a socket's address holds.
  std::string dir = "/tmp/zs-probes-test.XXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  const std::string address = absl::StrCat("unix:", dir, "/d.sock");

  // A directory others may enter is refused, naming the fix.
  ASSERT_EQ(::chmod(dir.c_str(), 0755), 0);
  DaemonOptions o;
  o.listen = address;
  absl::StatusOr<std::unique_ptr<Daemon>> refused = Daemon::Start(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("chmod 700"), absl::string_view::npos)
      << refused.status();

  ASSERT_EQ(::chmod(dir.c_str(), 0700), 0);
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->address(), address);
  struct stat st {};
  ASSERT_EQ(::stat((dir + "/d.sock").c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  grpc::Status status;
  EXPECT_EQ(Check(address, &status), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_TRUE(status.ok()) << status.error_message();
  testing::DaemonClient client(address);
  const v1::JobSpec spec = testing::MakeSpec("on-a-socket", testing::SampleLayout(), 3, 1, {address});
  grpc::Status s = client.Register(spec, 0);
  ASSERT_TRUE(s.ok()) << s.error_message();
  s = client.JoinAll(spec);
  EXPECT_TRUE(s.ok()) << s.error_message();

  // A second daemon on the same socket is refused: the first serves it.
  absl::StatusOr<std::unique_ptr<Daemon>> second = Daemon::Start(o);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  s = client.JoinAll(spec);
  EXPECT_TRUE(s.ok()) << "the first daemon stopped answering: " << s.error_message();

  // A path longer than a socket's address holds is refused before binding.
  o.listen = absl::StrCat("unix:", dir, "/", std::string(kMaxUnixSocketPathBytes, 's'));
  absl::StatusOr<std::unique_ptr<Daemon>> too_long = Daemon::Start(o);
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument) << too_long.status();
  d->reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace zeroshard
