// The daemon's bounds on streaming calls (docs/security.md, "Streams"): no
// stream is read before its token opened a job here, a stream whose peer
// stops is cancelled after --stream_idle_timeout_seconds, and requests in
// flight hold at most --max_rpc_threads threads.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/auth.h"
#include "gtest/gtest.h"
#include "proto/zeroshard/v1/activation.grpc.pb.h"
#include "proto/zeroshard/v1/replica.grpc.pb.h"
#include "proto/zeroshard/v1/shard.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "server/daemon.h"
#include "server/rpc/caller_calls.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using testing::DaemonClient;
using testing::kTestToken;

constexpr char kStrangerToken[] = "a-token-that-opens-nothing-here";

std::unique_ptr<Daemon> Start(absl::Duration idle, int threads = 256, int calls_per_caller = 0) {
  DaemonOptions options;
  options.max_calls_per_caller = calls_per_caller;
  options.listen = "127.0.0.1:0";
  options.activation_arena_bytes = 1 << 20;
  options.stream_idle_timeout = idle;
  options.max_rpc_threads = threads;
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(options);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

// A registered and joined one-daemon job, so that `token` opens a job.
void AddJob(Daemon& daemon, const std::string& job, const std::string& token = kTestToken) {
  const v1::JobSpec spec = testing::MakeSpec(job, testing::SampleLayout(), 2, 1, {daemon.address()});
  DaemonClient client(daemon.address(), token);
  ASSERT_TRUE(client.Register(spec, 0).ok());
  ASSERT_TRUE(client.Join(spec, 0).ok());
}

// Opens every client-streaming RPC of the daemon with `token` (none when
// empty), sends no message and waits for the daemon's answer (at most
// `wait`). Returns the status of each, by name.
std::vector<std::pair<std::string, grpc::Status>> SilentStreams(const std::string& address,
                                                                const std::string& token,
                                                                absl::Duration wait) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto shard = v1::Shard::NewStub(channel);
  auto activation = v1::Activation::NewStub(channel);
  auto replica = v1::Replica::NewStub(channel);
  auto call = [&](auto open) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + wait));
    if (!token.empty()) ctx.AddMetadata(kAuthorizationMetadataKey, std::string(kBearerPrefix) + token);
    return open(&ctx)->Finish();
  };
  std::vector<std::pair<std::string, grpc::Status>> out;
  v1::InitParametersResponse init;
  out.emplace_back("InitParameters",
                   call([&](grpc::ClientContext* c) { return shard->InitParameters(c, &init); }));
  v1::PushGradientResponse push;
  out.emplace_back("PushGradient",
                   call([&](grpc::ClientContext* c) { return shard->PushGradient(c, &push); }));
  v1::WriteStateResponse write;
  out.emplace_back("WriteState",
                   call([&](grpc::ClientContext* c) { return shard->WriteState(c, &write); }));
  v1::ActivationStored stored;
  out.emplace_back("OffloadActivation", call([&](grpc::ClientContext* c) {
                     return activation->OffloadActivation(c, &stored);
                   }));
  v1::TransferStateResponse transfer;
  out.emplace_back("TransferState", call([&](grpc::ClientContext* c) {
                     return replica->TransferState(c, &transfer);
                   }));
  v1::ForwardGradientResponse forward;
  out.emplace_back("ForwardGradient", call([&](grpc::ClientContext* c) {
                     return replica->ForwardGradient(c, &forward);
                   }));
  return out;
}

TEST(StreamLimitsTest, AStreamWithoutATokenIsRefusedBeforeItsFirstMessage) {
  std::unique_ptr<Daemon> daemon = Start(absl::ZeroDuration());
  ASSERT_NE(daemon, nullptr);
  AddJob(*daemon, "job");
  // Without the check the daemon waits for a first message that never
  // comes, and the caller's deadline ends the call.
  for (const auto& [rpc, s] : SilentStreams(daemon->address(), "", absl::Seconds(5))) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << rpc << ": " << s.error_message();
  }
}

TEST(StreamLimitsTest, AStreamWhoseTokenOpensNoJobIsRefusedBeforeItsFirstMessage) {
  std::unique_ptr<Daemon> daemon = Start(absl::ZeroDuration());
  ASSERT_NE(daemon, nullptr);
  AddJob(*daemon, "job");
  for (const auto& [rpc, s] : SilentStreams(daemon->address(), kStrangerToken, absl::Seconds(5))) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << rpc << ": " << s.error_message();
    EXPECT_NE(s.error_message().find("nothing was read"), std::string::npos) << rpc;
  }
}

TEST(StreamLimitsTest, AnIdleStreamIsCancelledAndCounted) {
  std::unique_ptr<Daemon> daemon = Start(absl::Seconds(1));
  ASSERT_NE(daemon, nullptr);
  AddJob(*daemon, "job");
  // The job's own token passes the check; then nothing comes. The caller's
  // deadline (10 s) is far past the idle limit (1 s).
  for (const auto& [rpc, s] : SilentStreams(daemon->address(), kTestToken, absl::Seconds(10))) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << rpc << ": " << s.error_message();
    // The caller learns of the cancel before the handler has returned.
    const absl::Time settle = absl::Now() + absl::Seconds(5);
    while (testing::RequestCount(*daemon, rpc, "DEADLINE_EXCEEDED") == 0 && absl::Now() < settle) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(testing::RequestCount(*daemon, rpc, "DEADLINE_EXCEEDED"), 1) << rpc;
  }
}

TEST(StreamLimitsTest, AStreamStalledMidwayAppliesNothing) {
  std::unique_ptr<Daemon> daemon = Start(absl::Seconds(1));
  ASSERT_NE(daemon, nullptr);
  AddJob(*daemon, "job");
  testing::ExpectRejected(*daemon, "job", grpc::StatusCode::CANCELLED, "", [&] {
    DaemonClient client(daemon->address());
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::PushGradientResponse resp;
    std::unique_ptr<grpc::ClientWriter<v1::GradientChunk>> writer =
        client.shard->PushGradient(&ctx, &resp);
    const std::vector<float> grad(16, 1.0f);
    absl::StatusOr<JobConfig> config = ParseJobSpec(
        testing::MakeSpec("job", testing::SampleLayout(), 2, 1, {daemon->address()}));
    EXPECT_TRUE(config.ok());
    const std::vector<v1::GradientChunk> chunks = testing::GradientChunks(
        "job", 1, 0, config->map, FlatRange{0, 16}, grad.data(), 16);
    EXPECT_TRUE(writer->Write(chunks[0]));
    // ... and then nothing, not even the end of the stream.
    return writer->Finish();
  });
}

// One PushGradient call with kTestToken on a connection of its own
// (`connection` tells them apart) that sends nothing; returns how it ended.
grpc::Status IdlePush(const std::string& address, int connection, grpc::ClientContext* ctx) {
  grpc::ChannelArguments args;
  args.SetInt("zs.test_connection", connection);
  auto shard = v1::Shard::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  ctx->AddMetadata(kAuthorizationMetadataKey, std::string(kBearerPrefix) + kTestToken);
  v1::PushGradientResponse resp;
  return shard->PushGradient(ctx, &resp)->Finish();
}

TEST(StreamLimitsTest, RequestsInFlightHoldAtMostMaxRpcThreads) {
  constexpr int kThreads = 8;
  constexpr int kCalls = 24;
  // One caller may take every thread here: the bound under test is gRPC's.
  std::unique_ptr<Daemon> daemon = Start(absl::Seconds(2), kThreads, kThreads);
  ASSERT_NE(daemon, nullptr);
  AddJob(*daemon, "job");
  // kCalls idle streams with the job's token, each on its own connection;
  // those past the thread quota are answered at once.
  std::atomic<int> exhausted{0};
  std::atomic<int> cancelled{0};
  std::vector<std::thread> callers;
  for (int i = 0; i < kCalls; ++i) {
    callers.emplace_back([&, i] {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
      const grpc::Status s = IdlePush(daemon->address(), i, &ctx);
      if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) ++exhausted;
      if (s.error_code() == grpc::StatusCode::CANCELLED) ++cancelled;
    });
  }
  for (std::thread& t : callers) t.join();
  // Every call ended within the idle limit or at once; at most kThreads
  // were held by a thread of the daemon's at a time.
  EXPECT_EQ(exhausted + cancelled, kCalls);
  EXPECT_GE(exhausted.load(), kCalls - kThreads);
  // The daemon serves again once they are gone.
  DaemonClient client(daemon->address());
  v1::StepState state;
  EXPECT_TRUE(client.StepState("job", &state).ok());
}

// Polls `call` every 10 ms until it returns `code` (at most 10 s); returns
// the last status.
template <typename Call>
grpc::Status Until(grpc::StatusCode code, Call call) {
  const absl::Time until = absl::Now() + absl::Seconds(10);
  grpc::Status s = call();
  while (s.error_code() != code && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
    s = call();
  }
  return s;
}

TEST(StreamLimitsTest, OneCallerHoldsAtMostMaxCallsPerCaller) {
  constexpr int kThreads = 16;
  constexpr int kPerCaller = 4;
  std::unique_ptr<Daemon> daemon = Start(absl::Seconds(30), kThreads, kPerCaller);
  ASSERT_NE(daemon, nullptr);
  AddJob(*daemon, "job");
  AddJob(*daemon, "other", "the-other-jobs-own-token");
  // kPerCaller idle streams of the job's token, each on its own connection,
  // held until cancelled below.
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  for (int i = 0; i < kPerCaller; ++i) contexts.push_back(std::make_unique<grpc::ClientContext>());
  std::atomic<int> ended{0};
  std::vector<std::thread> holders;
  for (int i = 0; i < kPerCaller; ++i) {
    holders.emplace_back([&, i] {
      contexts[i]->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(25)));
      (void)IdlePush(daemon->address(), i, contexts[i].get());
      ++ended;
    });
  }
  const uint64_t key = CallerCalls::TokenKey(std::string(kBearerPrefix) + kTestToken);
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (daemon->caller_calls().InFlight(key) < kPerCaller && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(daemon->caller_calls().InFlight(key), kPerCaller);
  // With all of them in, one more call of that token is refused...
  DaemonClient job(daemon->address());
  v1::StepState state;
  grpc::Status s = job.StepState("job", &state);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("--max_calls_per_caller=4"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(ended.load(), 0);
  EXPECT_EQ(daemon->caller_calls().InFlight(key), kPerCaller);
  // ... while another job's caller is served, with threads to spare.
  DaemonClient other(daemon->address(), "the-other-jobs-own-token");
  for (int i = 0; i < 3; ++i) {
    s = other.StepState("other", &state);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  // When its calls end, the job's caller is served again.
  for (auto& ctx : contexts) ctx->TryCancel();
  for (std::thread& t : holders) t.join();
  s = Until(grpc::StatusCode::OK, [&] { return job.StepState("job", &state); });
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// Server reflection needs no token, and its stream holds a thread while its
// peer keeps it open: one address may hold kReflectionCallsPerAddress of
// them, the rest are cancelled. Health checks meanwhile are answered.
TEST(StreamLimitsTest, ReflectionStreamsAreBoundedPerAddress) {
  std::unique_ptr<Daemon> daemon = Start(absl::Seconds(30));
  ASSERT_NE(daemon, nullptr);
  constexpr int kLimit = CallerCalls::kReflectionCallsPerAddress;
  constexpr int kCalls = kLimit + 4;
  auto channel = grpc::CreateChannel(daemon->address(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  struct Open {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call;
    grpc::Status status;
  };
  std::vector<std::unique_ptr<Open>> open;
  for (int i = 0; i < kCalls; ++i) {
    auto o = std::make_unique<Open>();
    o->ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(25)));
    o->call = stub.PrepareCall(&o->ctx,
                               "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                               &cq);
    o->call->StartCall(reinterpret_cast<void*>(static_cast<intptr_t>(2 * i)));
    open.push_back(std::move(o));
  }
  for (int i = 0; i < kCalls; ++i) {
    open[i]->call->Finish(&open[i]->status,
                          reinterpret_cast<void*>(static_cast<intptr_t>(2 * i + 1)));
  }
  // The calls past the limit end at once, cancelled; the others stay open.
  int finished = 0;
  int started = 0;
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (finished < kCalls - kLimit || started < kCalls) {
    void* tag = nullptr;
    bool ok = false;
    const auto next = cq.AsyncNext(&tag, &ok, absl::ToChronoTime(until));
    ASSERT_EQ(next, grpc::CompletionQueue::GOT_EVENT) << finished << " calls ended";
    const intptr_t t = reinterpret_cast<intptr_t>(tag);
    if (t % 2 == 0) {
      ++started;
      continue;
    }
    ++finished;
    EXPECT_EQ(open[t / 2]->status.error_code(), grpc::StatusCode::CANCELLED);
  }
  // Nothing more ends for a while: kLimit streams are held.
  void* tag = nullptr;
  bool ok = false;
  EXPECT_EQ(cq.AsyncNext(&tag, &ok, absl::ToChronoTime(absl::Now() + absl::Milliseconds(500))),
            grpc::CompletionQueue::TIMEOUT);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status s =
        grpc::health::v1::Health::NewStub(channel)->Check(&ctx, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  for (auto& o : open) o->ctx.TryCancel();
  for (int i = finished; i < kCalls; ++i) {
    ASSERT_EQ(cq.AsyncNext(&tag, &ok, absl::ToChronoTime(absl::Now() + absl::Seconds(10))),
              grpc::CompletionQueue::GOT_EVENT);
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

// A peer that connects and sends nothing (no TLS, no HTTP/2 preface) holds
// its connection only for the handshake timeout.
TEST(StreamLimitsTest, AConnectionThatNeverHandshakesIsClosed) {
  DaemonOptions options;
  options.listen = "127.0.0.1:0";
  options.handshake_timeout = absl::Milliseconds(500);
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string address = (*daemon)->address();
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0) << std::strerror(errno);
  const absl::Time start = absl::Now();
  // The server's preface (SETTINGS) may come first; then the close.
  pollfd p{fd, POLLIN, 0};
  char buffer[4096];
  bool closed = false;
  while (!closed && absl::Now() - start < absl::Seconds(10)) {
    if (::poll(&p, 1, 1000) <= 0) continue;
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    closed = n <= 0;
  }
  const absl::Duration held = absl::Now() - start;
  ::close(fd);
  EXPECT_TRUE(closed) << "the connection was still open after " << held;
  EXPECT_LT(held, absl::Seconds(5));
  // The daemon still serves.
  DaemonClient client(address);
  v1::StatusRequest request;
  v1::StatusResponse response;
  grpc::ClientContext ctx;
  EXPECT_TRUE(client.admin->Status(&ctx, request, &response).ok());
}

// A connection without calls for the idle timeout is closed by the daemon;
// its client reconnects for its next call.
TEST(StreamLimitsTest, AnIdleConnectionIsClosedAndTheClientReconnects) {
  DaemonOptions options;
  options.listen = "127.0.0.1:0";
  options.connection_idle_timeout = absl::Seconds(1);
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  DaemonClient client((*daemon)->address());
  auto status = [&] {
    v1::StatusRequest request;
    v1::StatusResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    return client.admin->Status(&ctx, request, &response);
  };
  ASSERT_TRUE(status().ok());
  EXPECT_EQ(client.channel->GetState(false), GRPC_CHANNEL_READY);
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (client.channel->GetState(false) == GRPC_CHANNEL_READY && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_NE(client.channel->GetState(false), GRPC_CHANNEL_READY)
      << "the daemon kept an idle connection open";
  EXPECT_TRUE(status().ok());
}

TEST(StreamLimitsTest, BadLimitsAreRefusedAtStart) {
  DaemonOptions options;
  options.max_rpc_threads = 2;
  absl::Status s = Daemon::Start(options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--max_rpc_threads"), std::string::npos) << s;
  options.max_rpc_threads = 256;
  options.stream_idle_timeout = absl::Milliseconds(10);
  s = Daemon::Start(options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--stream_idle_timeout_seconds"), std::string::npos) << s;
  options.stream_idle_timeout = absl::Seconds(60);
  options.max_calls_per_caller = 257;
  s = Daemon::Start(options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--max_calls_per_caller"), std::string::npos) << s;
  options.max_calls_per_caller = 0;
  options.handshake_timeout = absl::ZeroDuration();
  s = Daemon::Start(options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("handshake timeout"), std::string::npos) << s;
}

}  // namespace
}  // namespace zeroshard
