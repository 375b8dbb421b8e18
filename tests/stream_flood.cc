// stream_flood: what a caller on a daemon's port can do to it, measured.
// Prints key=value lines on stdout (one run, one mode):
//
//   --mode=flood     --streams calls of Shard/PushGradient over --channels TCP
//                    connections, none of which sends a message, held open
//                    for --hold_s seconds and then cancelled. Prints how many
//                    the daemon ended before the hold was over
//                    (flood_ended_early), by status code (flood_early_<CODE>).
//                    Says "flood: N streams open" on stderr once every call
//                    has started.
//   --mode=status    Admin/Status every 100 ms for --hold_s seconds: the calls,
//                    the failed ones, and the latency's p50 and max in ms.
//   --mode=register  --calls RegisterJob calls of a well-formed new job each,
//                    without the registration token: how many were refused
//                    (PERMISSION_DENIED or UNAUTHENTICATED), by status code.
//   --mode=manifest  rewrites the MANIFEST of checkpoint --name of job --job
//                    (in --checkpoint_dir) so that every file claims blocks of
//                    2^62 bytes, as a hostile writer could, then asks the
//                    daemon to VerifyCheckpoint it: the answer's code
//                    (manifest_verify=<CODE>, its message on stderr), and
//                    whether Admin.Status answers after (manifest_alive=).
//   --mode=promote   over mutual TLS with --tls_cert/--tls_key/--tls_ca (a
//                    trainer's certificate), registers job --job with
//                    replicas = 2 on --target (daemon 0) and --peer (daemon
//                    1), then asks daemon 1 to promote its backup of group 0
//                    while daemon 0, its primary, serves: the answer's code
//                    (promote_code=<CODE>, its message on stderr) and the
//                    backup's role after (promote_backup_role=).
//   --mode=arena_key a daemon serving --bulk_transport=grpc with an activation
//                    arena: job --job (one rank, this --token, the
//                    registration token --registration_token) joins, gets the
//                    arena's key from ExchangeEndpoint and writes the arena
//                    with it; its rank leaves (the job ends); job <--job>-next
//                    (token --next_token) joins and gets the arena; then the
//                    first job's saved key is tried on the same connection:
//                    arena_old_key_put=<CODE>, arena_old_key_get=<CODE>, and
//                    the new tenant's: arena_new_key_put=, arena_new_key_get=,
//                    arena_keys_differ=.
//
// --token, when not empty, goes with every call as "authorization: Bearer".
// Exit 0 when the run took place (the caller judges the figures), 1 when it
// could not (no connection, calls that never ended), 2 for bad flags.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "common/channel.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard/v1/admin.grpc.pb.h"
#include "proto/zeroshard/v1/checkpoint.grpc.pb.h"
#include "proto/zeroshard/v1/control.grpc.pb.h"
#include "proto/zeroshard/v1/replica.grpc.pb.h"
#include "proto/zeroshard/v1/shard.grpc.pb.h"
#include "transport/transport.h"

ABSL_FLAG(std::string, target, "", "The daemon, HOST:PORT.");
ABSL_FLAG(std::string, mode, "flood", "flood, status, register, manifest or promote.");
ABSL_FLAG(std::string, token, "", "Bearer token sent with every call; empty: none.");
ABSL_FLAG(int, streams, 3000, "flood: calls held open.");
ABSL_FLAG(int, channels, 30, "flood: TCP connections the calls are spread over.");
ABSL_FLAG(int, hold_s, 20, "flood, status: seconds to run.");
ABSL_FLAG(int, calls, 64, "register: RegisterJob calls.");
ABSL_FLAG(std::string, checkpoint_dir, "", "manifest: the daemon's --checkpoint_dir.");
ABSL_FLAG(std::string, job, "", "manifest: the job whose checkpoint is rewritten.");
ABSL_FLAG(std::string, name, "", "manifest: the checkpoint rewritten.");
ABSL_FLAG(std::string, peer, "", "promote: the second daemon, HOST:PORT.");
ABSL_FLAG(std::string, tls_cert, "", "promote: the caller's certificate (PEM).");
ABSL_FLAG(std::string, tls_key, "", "promote: its key (PEM).");
ABSL_FLAG(std::string, tls_ca, "", "promote: the CA that signs the daemons' certificates.");
ABSL_FLAG(std::string, registration_token, "", "arena_key: the daemon's registration token.");
ABSL_FLAG(std::string, next_token, "", "arena_key: the second job's token.");

namespace zs = zeroshard;
namespace v1 = zeroshard::v1;

namespace {

std::string CodeName(grpc::StatusCode code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

// The layout of every job this tool registers: one small tensor.
absl::StatusOr<zs::Layout> SmallLayout() {
  return zs::Layout::Create({zs::TensorSpec{"w", {256}}});
}

void AddToken(grpc::ClientContext* ctx, const std::string& token) {
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
}

// The calls that have ended, by status code, and whether the hold was still
// on when they did.
class Tally {
 public:
  void Ended(grpc::StatusCode code) {
    absl::MutexLock lock(&mu_);
    ++ended_;
    if (holding_) ++early_[CodeName(code)];
  }
  void EndHold() {
    absl::MutexLock lock(&mu_);
    holding_ = false;
  }
  // Waits up to `timeout` until `n` calls have ended; false if they did not.
  bool AwaitEnded(int n, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto all = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ended_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&all), timeout);
  }
  int ended() {
    absl::MutexLock lock(&mu_);
    return ended_;
  }
  std::map<std::string, int> early() {
    absl::MutexLock lock(&mu_);
    return early_;
  }

 private:
  absl::Mutex mu_;
  bool holding_ ABSL_GUARDED_BY(mu_) = true;
  int ended_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, int> early_ ABSL_GUARDED_BY(mu_);
};

// One PushGradient call that sends its headers and nothing else: the daemon
// sees a stream whose first message never comes.
class IdleStream : public grpc::ClientWriteReactor<v1::GradientChunk> {
 public:
  IdleStream(v1::Shard::Stub* stub, const std::string& token, Tally* tally) : tally_(tally) {
    AddToken(&ctx_, token);
    stub->async()->PushGradient(&ctx_, &response_, this);
    StartCall();
  }
  void Cancel() { ctx_.TryCancel(); }
  void OnDone(const grpc::Status& status) override { tally_->Ended(status.error_code()); }

 private:
  grpc::ClientContext ctx_;
  v1::PushGradientResponse response_;
  Tally* tally_;
};

int Flood(const std::string& target, const std::string& token) {
  const int n = absl::GetFlag(FLAGS_streams);
  const int c = absl::GetFlag(FLAGS_channels);
  if (n < 1 || c < 1) return 2;
  std::vector<std::unique_ptr<v1::Shard::Stub>> stubs;
  for (int i = 0; i < c; ++i) {
    // Channels with equal arguments share one connection; this one differs.
    grpc::ChannelArguments args;
    args.SetInt("zs.flood_channel", i);
    std::shared_ptr<grpc::Channel> channel =
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
    if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
      std::fprintf(stderr, "flood: channel %d did not connect to %s within 10 s\n", i,
                   target.c_str());
      return 1;
    }
    stubs.push_back(v1::Shard::NewStub(channel));
  }
  Tally tally;
  std::vector<std::unique_ptr<IdleStream>> calls;
  for (int i = 0; i < n; ++i) {
    calls.push_back(std::make_unique<IdleStream>(stubs[i % c].get(), token, &tally));
  }
  std::fprintf(stderr, "flood: %d streams open over %d connections\n", n, c);
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_hold_s)));
  tally.EndHold();
  const int early = tally.ended();
  for (auto& call : calls) call->Cancel();
  const bool all_ended = tally.AwaitEnded(n, absl::Seconds(20));
  std::printf("flood_streams=%d\nflood_channels=%d\nflood_ended_early=%d\n", n, c, early);
  for (const auto& [code, count] : tally.early()) {
    std::printf("flood_early_%s=%d\n", code.c_str(), count);
  }
  if (!all_ended) {
    std::printf("flood_unended=%d\n", n - tally.ended());
    std::fflush(stdout);
    // Calls still in flight cannot be destroyed; leave without trying.
    _exit(1);
  }
  return 0;
}

int StatusProbe(const std::string& target, const std::string& token) {
  std::unique_ptr<v1::Admin::Stub> stub =
      v1::Admin::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  std::vector<double> ms;
  int failed = 0;
  using Clock = std::chrono::steady_clock;
  const Clock::time_point end = Clock::now() + std::chrono::seconds(absl::GetFlag(FLAGS_hold_s));
  for (Clock::time_point next = Clock::now(); next < end;
       next += std::chrono::milliseconds(100)) {
    std::this_thread::sleep_until(next);
    grpc::ClientContext ctx;
    AddToken(&ctx, token);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::StatusResponse response;
    const Clock::time_point start = Clock::now();
    grpc::Status s = stub->Status(&ctx, v1::StatusRequest(), &response);
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    if (!s.ok()) {
      ++failed;
      std::fprintf(stderr, "status: %s: %s\n", CodeName(s.error_code()).c_str(),
                   s.error_message().c_str());
    }
  }
  if (ms.empty()) return 1;
  std::sort(ms.begin(), ms.end());
  std::printf("status_calls=%zu\nstatus_failed=%d\nstatus_p50_ms=%.1f\nstatus_max_ms=%.1f\n",
              ms.size(), failed, ms[(ms.size() - 1) / 2], ms.back());
  return 0;
}

int Register(const std::string& target, const std::string& token) {
  // A spec the daemon accepts, so that what refuses it is the missing
  // registration token and not the spec.
  absl::StatusOr<zs::Layout> layout = SmallLayout();
  if (!layout.ok()) return 1;
  std::unique_ptr<v1::Control::Stub> stub =
      v1::Control::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  const int k = absl::GetFlag(FLAGS_calls);
  std::map<std::string, int> codes;
  int refused = 0;
  for (int i = 0; i < k; ++i) {
    zs::JobSettings settings;
    settings.job_id = absl::StrCat("flood-", getpid(), "-", i);
    settings.stage = 3;
    settings.daemons = {target};
    v1::RegisterJobRequest request;
    *request.mutable_spec() = zs::ToJobSpec(settings, *layout);
    grpc::ClientContext ctx;
    AddToken(&ctx, token);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::RegisterJobResponse response;
    grpc::Status s = stub->RegisterJob(&ctx, request, &response);
    ++codes[CodeName(s.error_code())];
    if (s.error_code() == grpc::StatusCode::PERMISSION_DENIED ||
        s.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      ++refused;
    } else if (!s.ok()) {
      std::fprintf(stderr, "register: %s: %s\n", CodeName(s.error_code()).c_str(),
                   s.error_message().c_str());
    }
  }
  std::printf("register_calls=%d\nregister_refused=%d\n", k, refused);
  for (const auto& [code, count] : codes) std::printf("register_%s=%d\n", code.c_str(), count);
  return 0;
}

int HostileManifest(const std::string& target, const std::string& token) {
  const std::string job = absl::GetFlag(FLAGS_job);
  const std::string name = absl::GetFlag(FLAGS_name);
  const std::string path =
      absl::StrCat(absl::GetFlag(FLAGS_checkpoint_dir), "/", job, "/", name, "/MANIFEST");
  v1::CheckpointManifest manifest;
  {
    std::ifstream in(path, std::ios::binary);
    if (!in || !manifest.ParseFromIstream(&in)) {
      std::fprintf(stderr, "manifest: cannot read %s\n", path.c_str());
      return 1;
    }
  }
  int files = 0;
  for (v1::PartManifest& part : *manifest.mutable_parts()) {
    for (v1::CheckpointFile& file : *part.mutable_files()) {
      file.set_block_bytes(uint64_t{1} << 62);
      ++files;
    }
  }
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out || !manifest.SerializeToOstream(&out)) {
      std::fprintf(stderr, "manifest: cannot write %s\n", path.c_str());
      return 1;
    }
  }
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::ClientContext ctx;
  AddToken(&ctx, token);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::VerifyCheckpointRequest request;
  request.set_job_id(job);
  request.set_name(name);
  v1::VerifyCheckpointResponse response;
  const grpc::Status s = v1::Checkpoint::NewStub(channel)->VerifyCheckpoint(&ctx, request, &response);
  std::fprintf(stderr, "manifest: VerifyCheckpoint: %s: %s\n", CodeName(s.error_code()).c_str(),
               s.error_message().c_str());
  grpc::ClientContext status_ctx;
  AddToken(&status_ctx, token);
  status_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::StatusResponse status;
  const grpc::Status alive =
      v1::Admin::NewStub(channel)->Status(&status_ctx, v1::StatusRequest(), &status);
  std::printf("manifest_files=%d\nmanifest_verify=%s\nmanifest_alive=%d\n", files,
              CodeName(s.error_code()).c_str(), alive.ok() ? 1 : 0);
  return 0;
}

int Promote(const std::string& target, const std::string& token) {
  const std::string peer = absl::GetFlag(FLAGS_peer);
  const std::string job = absl::GetFlag(FLAGS_job);
  if (peer.empty() || job.empty()) {
    std::fputs("stream_flood: --mode=promote needs --peer and --job\n", stderr);
    return 2;
  }
  absl::StatusOr<zs::ChannelSecurity> security = zs::MakeChannelSecurity(
      zs::TlsFiles{absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                   absl::GetFlag(FLAGS_tls_ca)},
      token, "--tls");
  if (!security.ok()) {
    std::fprintf(stderr, "promote: %s\n", std::string(security.status().message()).c_str());
    return 2;
  }
  absl::StatusOr<zs::Layout> layout = SmallLayout();
  if (!layout.ok()) return 1;
  zs::JobSettings settings;
  settings.job_id = job;
  settings.stage = 3;
  settings.world_size = 2;
  settings.replicas = 2;
  settings.daemons = {target, peer};
  const std::shared_ptr<grpc::Channel> channels[2] = {
      zs::MakeChannel(target, *security, grpc::ChannelArguments()),
      zs::MakeChannel(peer, *security, grpc::ChannelArguments())};
  auto deadline = [] { return std::chrono::system_clock::now() + std::chrono::seconds(10); };
  for (uint32_t d = 0; d < 2; ++d) {
    v1::RegisterJobRequest request;
    *request.mutable_spec() = zs::ToJobSpec(settings, *layout);
    request.set_daemon_index(d);
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline());
    v1::RegisterJobResponse response;
    const grpc::Status s = v1::Control::NewStub(channels[d])->RegisterJob(&ctx, request, &response);
    if (!s.ok()) {
      std::fprintf(stderr, "promote: RegisterJob on daemon %u: %s: %s\n", d,
                   CodeName(s.error_code()).c_str(), s.error_message().c_str());
      return 1;
    }
  }
  std::unique_ptr<v1::Replica::Stub> replica = v1::Replica::NewStub(channels[1]);
  v1::PromoteRequest request;
  request.set_job_id(job);
  request.set_group(0);
  request.set_epoch(2);
  grpc::ClientContext ctx;
  ctx.set_deadline(deadline());
  v1::ReplicaState promoted;
  const grpc::Status s = replica->Promote(&ctx, request, &promoted);
  std::printf("promote_code=%s\n", CodeName(s.error_code()).c_str());
  std::fprintf(stderr, "promote: %s\n", s.error_message().c_str());
  grpc::ClientContext state_ctx;
  state_ctx.set_deadline(deadline());
  v1::GetReplicaStateRequest state_request;
  state_request.set_job_id(job);
  v1::ReplicaState state;
  const grpc::Status read = replica->GetReplicaState(&state_ctx, state_request, &state);
  if (!read.ok()) {
    std::fprintf(stderr, "promote: GetReplicaState: %s\n", read.error_message().c_str());
    return 1;
  }
  for (const v1::ReplicaGroupState& g : state.groups()) {
    if (g.group() != 0) continue;
    std::printf("promote_backup_role=%s\npromote_backup_epoch=%llu\n",
                g.role() == v1::REPLICA_ROLE_PRIMARY ? "PRIMARY" : "BACKUP",
                static_cast<unsigned long long>(g.epoch()));
  }
  return 0;
}

// One job with one rank whose token is `token`: registers it (with the
// registration token), joins rank 0 and exchanges endpoints over the grpc
// bulk transport `bulk`. Returns the arena's region and the daemon's
// transport address, or the failed call's status.
struct ArenaLease {
  zs::transport::RegionDescriptor arena;
  std::string worker_address;
};

absl::StatusOr<ArenaLease> JoinAndLeaseArena(const std::string& target, const std::string& job,
                                             const std::string& token,
                                             zs::transport::Transport& bulk) {
  absl::StatusOr<zs::Layout> layout = SmallLayout();
  if (!layout.ok()) return layout.status();
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  auto context = [&](grpc::ClientContext* ctx) {
    AddToken(ctx, token);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  };
  auto failed = [&](const char* rpc, const grpc::Status& s) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat(job, ": ", rpc, ": ", s.error_message()));
  };
  zs::JobSettings settings;
  settings.job_id = job;
  settings.stage = 3;
  settings.daemons = {target};
  v1::RegisterJobRequest reg;
  *reg.mutable_spec() = zs::ToJobSpec(settings, *layout);
  {
    grpc::ClientContext ctx;
    context(&ctx);
    ctx.AddMetadata(zs::kRegistrationMetadataKey, absl::GetFlag(FLAGS_registration_token));
    v1::RegisterJobResponse resp;
    grpc::Status s = v1::Control::NewStub(channel)->RegisterJob(&ctx, reg, &resp);
    if (!s.ok()) return failed("RegisterJob", s);
  }
  {
    v1::JoinJobRequest join;
    join.set_job_id(job);
    join.set_rank(0);
    join.set_layout_fingerprint(layout->fingerprint());
    join.set_stage(3);
    join.set_world_size(1);
    join.set_precision(reg.spec().precision());
    join.set_incarnation(1);
    grpc::ClientContext ctx;
    context(&ctx);
    v1::JoinJobResponse resp;
    grpc::Status s = v1::Control::NewStub(channel)->JoinJob(&ctx, join, &resp);
    if (!s.ok()) return failed("JoinJob", s);
  }
  v1::ExchangeEndpointRequest req;
  req.set_job_id(job);
  req.set_rank(0);
  req.set_incarnation(1);
  req.set_transport(v1::TRANSPORT_KIND_GRPC);
  req.set_worker_address(bulk.LocalAddress());
  v1::ExchangeEndpointResponse resp;
  grpc::ClientContext ctx;
  context(&ctx);
  grpc::Status s = v1::Shard::NewStub(channel)->ExchangeEndpoint(&ctx, req, &resp);
  if (!s.ok()) return failed("ExchangeEndpoint", s);
  for (const v1::RemoteRegion& r : resp.regions()) {
    if (r.purpose() != v1::REGION_PURPOSE_ACTIVATION_ARENA) continue;
    return ArenaLease{zs::transport::RegionDescriptor{r.address(), r.length(), r.rkey()},
                      resp.worker_address()};
  }
  return absl::FailedPreconditionError(
      absl::StrCat(job, ": ExchangeEndpoint lent no activation arena"));
}

int ArenaKey(const std::string& target, const std::string& token) {
  const std::string job = absl::GetFlag(FLAGS_job);
  const std::string next_token = absl::GetFlag(FLAGS_next_token);
  if (job.empty() || token.empty() || next_token.empty()) {
    std::fputs("stream_flood: --mode=arena_key needs --job, --token and --next_token\n", stderr);
    return 2;
  }
  absl::StatusOr<std::unique_ptr<zs::transport::Transport>> bulk =
      zs::transport::CreateTransport("grpc");
  if (!bulk.ok()) {
    std::fprintf(stderr, "arena_key: %s\n", bulk.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<ArenaLease> first = JoinAndLeaseArena(target, job, token, **bulk);
  if (!first.ok()) {
    std::fprintf(stderr, "arena_key: %s\n", first.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<zs::transport::Connection>> connection =
      (*bulk)->Connect(first->worker_address, absl::Now() + absl::Seconds(10));
  if (!connection.ok()) {
    std::fprintf(stderr, "arena_key: connect: %s\n", connection.status().ToString().c_str());
    return 1;
  }
  std::string bytes(4096, '\x5a');
  std::string back(bytes.size(), '\0');
  auto put = [&](const zs::transport::RegionDescriptor& key) {
    return (*connection)
        ->Put(bytes.data(), bytes.size(), key, 0)
        .Wait(absl::Now() + absl::Seconds(10));
  };
  auto get = [&](const zs::transport::RegionDescriptor& key) {
    return (*connection)
        ->Get(back.data(), back.size(), key, 0)
        .Wait(absl::Now() + absl::Seconds(10));
  };
  const absl::Status own = put(first->arena);
  std::printf("arena_first_put=%s\n", absl::StatusCodeToString(own.code()).c_str());
  // The first job ends: its only rank leaves.
  {
    v1::LeaveRequest leave;
    leave.set_job_id(job);
    leave.set_rank(0);
    leave.set_incarnation(1);
    grpc::ClientContext ctx;
    AddToken(&ctx, token);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::LeaveResponse resp;
    grpc::Status s =
        v1::Control::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()))
            ->Leave(&ctx, leave, &resp);
    if (!s.ok()) {
      std::fprintf(stderr, "arena_key: Leave: %s\n", s.error_message().c_str());
      return 1;
    }
  }
  absl::StatusOr<ArenaLease> next = JoinAndLeaseArena(target, job + "-next", next_token, **bulk);
  if (!next.ok()) {
    std::fprintf(stderr, "arena_key: %s\n", next.status().ToString().c_str());
    return 1;
  }
  const absl::Status old_put = put(first->arena);
  const absl::Status old_get = get(first->arena);
  std::fprintf(stderr, "arena_key: the old key's put: %s\narena_key: its get: %s\n",
               old_put.ToString().c_str(), old_get.ToString().c_str());
  const absl::Status new_put = put(next->arena);
  const absl::Status new_get = get(next->arena);
  std::printf(
      "arena_old_key_put=%s\narena_old_key_get=%s\narena_new_key_put=%s\narena_new_key_get=%s\n"
      "arena_keys_differ=%d\n",
      absl::StatusCodeToString(old_put.code()).c_str(),
      absl::StatusCodeToString(old_get.code()).c_str(),
      absl::StatusCodeToString(new_put.code()).c_str(),
      absl::StatusCodeToString(new_get.code()).c_str(), first->arena.rkey != next->arena.rkey);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "stream_flood --target HOST:PORT --mode flood|status|register|manifest|promote|arena_key "
      "[--token T]");
  absl::ParseCommandLine(argc, argv);
  const std::string target = absl::GetFlag(FLAGS_target);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  const std::string token = absl::GetFlag(FLAGS_token);
  if (target.empty()) {
    std::fputs("stream_flood: --target is required\n", stderr);
    return 2;
  }
  if (mode == "flood") return Flood(target, token);
  if (mode == "status") return StatusProbe(target, token);
  if (mode == "register") return Register(target, token);
  if (mode == "manifest") return HostileManifest(target, token);
  if (mode == "promote") return Promote(target, token);
  if (mode == "arena_key") return ArenaKey(target, token);
  std::fprintf(stderr,
               "stream_flood: --mode must be flood, status, register, manifest, promote or "
               "arena_key, not %s\n",
               mode.c_str());
  return 2;
}
