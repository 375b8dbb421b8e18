// Replicated partitions (JobSpec.replicas = 2, proto/zeroshard/v1/replica.proto):
// what bringing a backup along costs. Two daemons run in this process on
// loopback; daemon d holds replica group d as its primary and the other
// group as its backup. The bench drives one fp32 AdamW job of --params
// parameters (stage --stage, --world_size ranks, daemon reduction) the way
// the leader does: every rank pushes its gradient slices (Shard.PushGradient
// streams of 4 MiB chunks), then PrepareStep on each group's primary, the
// norms combined, CommitStep on each; every job-scoped call carries the
// replica metadata (group, epoch). Measured, each as the median of its
// samples:
//
//   transfer  the state copy (Job::SendState: masters, m and v, 12 B per
//             parameter of the group) that the first PrepareStep of each
//             group runs, since the backup starts out of sync. With
//             --bulk_transport (ucx by default) the daemons run that bulk
//             transport and the backup reads the primary's arrays itself
//             (Get, CRC-32C per 4 MiB piece on both sides); with
//             --bulk_transport= (none) the primary streams them
//             (Replica.TransferState in 4 MiB chunks with CRC-32C). Two
//             figures:
//               log    bytes and seconds of the daemon's own line ("copied
//                      the state of step S to the backup on ADDR over the
//                      bulk transport: B bytes in T s"), read by teeing this
//                      process's stderr through a pipe (--capture_log);
//               delta  PrepareStep(1) latency minus the median PrepareStep
//                      latency of the later steps of the same group (which
//                      only forward the gradient), for 12 B per parameter.
//             The log figure is the transfer figure when it was captured
//             (it times exactly the stream and the backup's acceptance;
//             the delta also carries the first forward's first-touch of
//             the backup's forward buffer). Each of --jobs fresh replicated
//             jobs gives one transfer per group.
//   baseline  raw gRPC client streaming between the same kind of channels
//             for the same bytes: right after each job's transfers, the
//             same number of ReplicaStateChunk messages of the same sizes
//             (the same 3 x ceil(n / 1 Mi) chunks of <= 4 MiB) sent through
//             a GrpcReplicaLink (the daemons' own client, channel arguments
//             and WriteStream loop) to a sink server in this process (a
//             Replica service whose TransferState reads and drops every
//             chunk), built like the daemon's server (same message limits).
//             The payload is built once (no per-chunk copy into the message,
//             no CRC): what gRPC itself moves over loopback, the ceiling of
//             any transfer over it. --raw_streams streams per transfer.
//   transport with --bulk_transport: the transport's own bandwidth for the
//             same bytes, as the backup moves them: two transports of that
//             kind in this process, a Connect and one Get per array of the
//             group's size from a registered region into fresh buffers,
//             nothing else (no CRC, no gRPC call). --raw_streams reads per
//             transfer.
//   context   what touching memory costs on this host over the same bytes:
//             a fresh buffer (allocate, zero, copy in, free), a memcpy into
//             warm memory, CRC-32C; the transfer does each of these on the
//             way (the backup stages the whole state in fresh buffers, then
//             copies it into its arrays).
//   forward   PrepareStep latency of the steps after the first with
//             replicas = 2 (the primary forwards its reduced gradient, 4 B
//             per parameter of the group, and waits for the backup) against
//             the same job with replicas = 1 (--steps steps each); and
//             CommitStep's (the primary forwards the commit and waits for
//             the backup's update) beside it.
//   push      the PushGradient streams' throughput of the same runs (per
//             stream at most MaxPushStreamBytes(C_B), so several streams per
//             rank), for reference: a gRPC stream that the daemon applies.
//
// The summary line, then the last line (ratio < 1: the transfer is slower
// than its baseline: the raw transport's Gets with a bulk transport, the
// raw stream without):
//   transfer_gbps=A transfer_path=bulk|stream transfer_source=log|delta
//   transfer_delta_gbps=... grpc_stream_gbps=B transport_gbps=C
//   forward_added_s=... forward_gbps=...
//   transfer_vs_transport=A/C   (with --bulk_transport)
//   transfer_vs_grpc_stream=A/B (without)
//   bazel run -c opt --config=clang //bench:replica_bench -- --params=16777216
//
// Memory: each daemon holds its group (16 B per parameter of the group:
// masters, m, v, reduced gradient) and the backup of the other (the same,
// plus a 4 B forward buffer), and while it accepts a transfer a second 12 B
// copy; this process also holds the pushes' chunks (4 B per parameter per
// rank) and the initial parameters (4 B per parameter): with Ψ = 16 Mi
// (the default), world 2, about 1.3 GB in all, twice that at 32 Mi.
//
// Size: a daemon gives its backup resources.replica_timeout (5 s, fixed:
// server/job/job.h) for the transfer and the first forward together; past it
// the group goes on with one copy and this bench stops, saying so. The
// default keeps the transfer near 1 s on a small loaded host, well over the
// 100 ms that make it measurable, and the whole run under a minute on 2
// cores.

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/stats.h"
#include "common/channel.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "common/protocol.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard/v1/control.grpc.pb.h"
#include "proto/zeroshard/v1/replica.grpc.pb.h"
#include "proto/zeroshard/v1/shard.grpc.pb.h"
#include "server/daemon.h"
#include "server/rpc/grpc_replica_link.h"
#include "transport/transport.h"

ABSL_FLAG(uint64_t, params, 16ull << 20,
          "parameters of the job (Ψ), fp32 AdamW (the whole transfer and the first forward must "
          "fit the daemon's fixed 5 s replica timeout)");
ABSL_FLAG(uint32_t, stage, 2, "ZeRO stage (2 or 3; 1 works too)");
ABSL_FLAG(uint32_t, world_size, 2, "ranks N_d (partitions), split evenly over the 2 daemons");
ABSL_FLAG(int, jobs, 2, "fresh replicated jobs, each giving one state transfer per group");
ABSL_FLAG(int, raw_streams, 2,
          "raw gRPC streams to the sink per transfer (samples of the baseline)");
ABSL_FLAG(int, steps, 3,
          "steps per job after the first (forward-only PrepareSteps with replicas = 2; the "
          "replicas = 1 job runs as many after its first)");
ABSL_FLAG(uint64_t, bucket_bytes, 32ull << 20,
          "the job's bucket C_B (a push stream carries at most MaxPushStreamBytes(C_B))");
ABSL_FLAG(int, optimizer_threads, 1, "each daemon's optimizer threads");
ABSL_FLAG(std::string, bulk_transport, "ucx",
          "the daemons' bulk transport (ucx, inproc, grpc; empty: none, the state copy streams)");
ABSL_FLAG(std::string, ucx_tls, "", "UCX_TLS for a ucx bulk transport (empty: UCX's choice)");
ABSL_FLAG(bool, capture_log, true,
          "tee stderr through a pipe to read the daemons' transfer lines (bytes and seconds)");

namespace zeroshard {
namespace {

using bench::Median;

constexpr int kDaemons = 2;
constexpr char kToken[] = "replica-bench-job-token";
constexpr uint64_t kIncarnation = 1;
// As server/replica/replica_group.cc: 4 MiB of fp32 per transferred or forwarded chunk.
constexpr uint64_t kChunkElements = uint64_t{1} << 20;
// fp32 AdamW: masters, m, v.
constexpr uint64_t kStateArrays = 3;
constexpr float kLr = 1e-3f;
constexpr float kMaxNorm = 1.0f;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void SetDeadline(grpc::ClientContext* ctx, int seconds = 120) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
}

double Gbps(double bytes, double seconds) { return seconds > 0 ? bytes / seconds / 1e9 : NAN; }

// Pseudo-random values in [-0.5, 0.5) * scale, a different stream per seed.
float Noise(uint64_t i, uint32_t seed) {
  uint32_t x = static_cast<uint32_t>(i) * 2654435761u + seed * 40503u + 1;
  x ^= x >> 15;
  x *= 2246822519u;
  x ^= x >> 13;
  return static_cast<float>(x >> 8) * (1.0f / 16777216.0f) - 0.5f;
}

// ---- The daemons' transfer lines, read from this process's stderr ----

struct LoggedTransfer {
  std::string job;
  uint32_t group = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  bool bulk = false;  // over the bulk transport, not in the stream
};

// Points fd 2 at a pipe whose reader thread writes everything on to the
// original stderr and remembers the daemons' "copied the state" lines.
class StderrTee {
 public:
  bool Start() {
    int fds[2];
    if (::pipe(fds) != 0) return false;
    std::fflush(stderr);
    saved_ = ::dup(2);
    if (saved_ < 0 || ::dup2(fds[1], 2) < 0) {
      ::close(fds[0]);
      ::close(fds[1]);
      if (saved_ >= 0) ::close(saved_);
      saved_ = -1;
      return false;
    }
    ::close(fds[1]);
    read_ = fds[0];
    thread_ = std::thread([this] { Run(); });
    return true;
  }

  // Puts stderr back and waits for the reader to drain the pipe.
  void Stop() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);  // the pipe's last write end closes: the reader sees EOF
    thread_.join();
    ::close(read_);
    ::close(saved_);
    saved_ = -1;
  }

  // The transfer line of (job, group), waiting up to `timeout` for the
  // reader to get to it.
  std::optional<LoggedTransfer> Wait(const std::string& job, uint32_t group, double timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    std::optional<LoggedTransfer> found;
    cv_.wait_for(lock, std::chrono::duration<double>(timeout), [&] {
      for (const LoggedTransfer& t : transfers_) {
        if (t.job == job && t.group == group) {
          found = t;
          return true;
        }
      }
      return false;
    });
    return found;
  }

 private:
  void Run() {
    std::string pending;
    char buf[65536];
    for (;;) {
      const ssize_t n = ::read(read_, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      for (ssize_t off = 0; off < n;) {
        const ssize_t w = ::write(saved_, buf + off, n - off);
        if (w <= 0) break;
        off += w;
      }
      pending.append(buf, n);
      for (size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
        Parse(pending.substr(0, nl));
        pending.erase(0, nl + 1);
      }
    }
  }

  // server/replica/replica_group.cc, ReplicaGroup::SendState:
  //   zeroshardd: job J replica group G: copied the state of step S to the
  //   backup on ADDR over the bulk transport|in the stream: B bytes in T s
  //   (X GB/s)
  void Parse(const std::string& line) {
    if (line.find("copied the state of step") == std::string::npos) return;
    const size_t figures = line.find(" bytes in ");
    const size_t colon = line.rfind(": ", figures);
    if (figures == std::string::npos || colon == std::string::npos) return;
    char job[256] = {0};
    unsigned group = 0;
    unsigned long long bytes = 0;
    double seconds = 0;
    if (std::sscanf(line.c_str(), "zeroshardd: job %255s replica group %u:", job, &group) != 2 ||
        std::sscanf(line.c_str() + colon + 2, "%llu bytes in %lf s", &bytes, &seconds) != 2) {
      return;
    }
    const bool bulk = line.find("over the bulk transport", 0) < colon;
    std::lock_guard<std::mutex> lock(mu_);
    transfers_.push_back({job, group, bytes, seconds, bulk});
    cv_.notify_all();
  }

  int saved_ = -1;
  int read_ = -1;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<LoggedTransfer> transfers_;
};

StderrTee* g_tee = nullptr;  // while stderr is teed

// Puts stderr back (so the message is not lost in the pipe), says why and
// exits.
void Die(const std::string& what) {
  if (g_tee != nullptr) g_tee->Stop();
  std::fprintf(stderr, "replica_bench: %s\n", what.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  std::_Exit(1);
}

void Check(const grpc::Status& s, const std::string& what) {
  if (!s.ok()) Die(absl::StrCat(what, ": ", s.error_code(), " ", s.error_message()));
}

void Check(const absl::Status& s, const std::string& what) {
  if (!s.ok()) Die(absl::StrCat(what, ": ", s.ToString()));
}

// ---- The baseline's sink: a Replica service that drops what it reads ----

class SinkService final : public v1::Replica::Service {
 public:
  grpc::Status TransferState(grpc::ServerContext*,
                             grpc::ServerReader<v1::ReplicaStateChunk>* reader,
                             v1::TransferStateResponse* resp) override {
    v1::ReplicaStateChunk chunk;
    uint64_t bytes = 0;
    while (reader->Read(&chunk)) bytes += chunk.data().size();
    resp->set_bytes(bytes);
    return grpc::Status::OK;
  }
};

// Sends the chunks of a transfer of `n` elements per array (the transfer's
// chunking, a prebuilt payload) to the sink; returns the seconds from the
// call to the sink's answer.
double RawStream(GrpcReplicaLink& link, const std::string& sink, uint64_t n) {
  const std::string payload(kChunkElements * sizeof(float), '\x5a');
  uint64_t array = 0;
  uint64_t offset = 0;
  const double start = Now();
  absl::StatusOr<v1::TransferStateResponse> r = link.TransferState(
      sink, "",
      [&](v1::ReplicaStateChunk* chunk) {
        if (array == kStateArrays) return false;
        if (chunk->data().empty()) {
          chunk->set_job_id("sink");
          chunk->set_epoch(1);
        }
        const uint64_t count = std::min(kChunkElements, n - offset);
        chunk->set_array(static_cast<uint32_t>(array));
        chunk->set_offset(offset);
        if (chunk->data().size() != count * sizeof(float)) {
          chunk->mutable_data()->assign(payload.data(), count * sizeof(float));
        }
        offset += count;
        if (offset == n) {
          ++array;
          offset = 0;
        }
        return true;
      },
      absl::Now() + absl::Seconds(120));
  const double seconds = Now() - start;
  Check(r.status(), "raw stream to the sink");
  if (r->bytes() != kStateArrays * n * sizeof(float)) {
    Die(absl::StrCat("the sink read ", r->bytes(), " bytes, expected ",
                     kStateArrays * n * sizeof(float)));
  }
  return seconds;
}

// The bulk transport's own bandwidth for a group's state, moved as the
// backup moves it: Connect, then one Get per array from the source's
// registered region into fresh buffers.
class RawGets {
 public:
  RawGets(const std::string& kind, const std::string& ucx_tls, uint64_t n) : n_(n) {
    transport::TransportOptions common;
    common.name = "replica_bench source";
    transport::BackendOptions to;
    to.SetCommon(common);
    to.ucx.tls = ucx_tls;
    absl::StatusOr<std::unique_ptr<transport::Transport>> source =
        transport::CreateTransport(kind, to);
    Check(source.status(), "the baseline's source transport");
    common.name = "replica_bench reader";
    to.SetCommon(common);
    absl::StatusOr<std::unique_ptr<transport::Transport>> reader =
        transport::CreateTransport(kind, to);
    Check(reader.status(), "the baseline's reading transport");
    source_ = *std::move(source);
    reader_ = *std::move(reader);
    absl::StatusOr<std::unique_ptr<transport::Region>> region =
        source_->AllocateRegion(kStateArrays * n * sizeof(float), transport::Access::kRemoteRead);
    Check(region.status(), "the baseline's source region");
    region_ = *std::move(region);
    float* data = static_cast<float*>(region_->base());
    for (uint64_t i = 0; i < kStateArrays * n; ++i) data[i] = Noise(i, 5);
  }

  // Seconds for one read of the whole state.
  double Read() {
    const double start = Now();
    const absl::Time deadline = absl::Now() + absl::Seconds(120);
    absl::StatusOr<std::unique_ptr<transport::Connection>> c =
        reader_->Connect(source_->LocalAddress(), deadline);
    Check(c.status(), "the baseline's Connect");
    std::vector<std::unique_ptr<float[]>> dst;
    std::vector<transport::Completion> reads;
    const transport::RegionDescriptor& d = region_->Descriptor();
    for (uint64_t a = 0; a < kStateArrays; ++a) {
      dst.emplace_back(new float[n_]);
      const transport::RegionDescriptor array{d.address + a * n_ * sizeof(float),
                                              n_ * sizeof(float), d.rkey};
      reads.push_back((*c)->Get(dst.back().get(), n_ * sizeof(float), array, 0));
    }
    for (transport::Completion& r : reads) Check(r.Wait(deadline), "the baseline's Get");
    return Now() - start;
  }

 private:
  const uint64_t n_;
  std::unique_ptr<transport::Transport> source_;
  std::unique_ptr<transport::Transport> reader_;
  std::unique_ptr<transport::Region> region_;
};

// What touching memory costs on this host, over `bytes` (a group's state):
// a fresh buffer (allocated, zero-filled, copied into, freed: what the
// backup's staging of a transfer does), a copy into warm memory, CRC-32C.
void PrintMemoryContext(uint64_t bytes) {
  std::vector<char> src(bytes);
  for (uint64_t i = 0; i < bytes; i += 4096) src[i] = static_cast<char>(i >> 12);
  std::vector<char> warm(bytes, 0);
  double start = Now();
  {
    std::vector<char> fresh(bytes);
    std::memcpy(fresh.data(), src.data(), bytes);
    asm volatile("" : : "r"(fresh.data()) : "memory");  // keep the copy
  }
  const double fresh_s = Now() - start;
  start = Now();
  std::memcpy(warm.data(), src.data(), bytes);
  asm volatile("" : : "r"(warm.data()) : "memory");
  const double warm_s = Now() - start;
  start = Now();
  const uint32_t crc = Crc32c(src.data(), bytes);
  const double crc_s = Now() - start;
  std::printf(
      "context   over %llu B: fresh buffer (allocate, zero, copy in, free) %.3f GB/s, memcpy into "
      "warm memory %.3f GB/s, CRC-32C %.3f GB/s (%08x)\n",
      static_cast<unsigned long long>(bytes), Gbps(bytes, fresh_s), Gbps(bytes, warm_s),
      Gbps(bytes, crc_s), crc);
}

// ---- The job ----

struct Stubs {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Control::Stub> control;
  std::unique_ptr<v1::Shard::Stub> shard;
  std::unique_ptr<v1::Replica::Stub> replica;
};

std::unique_ptr<Stubs> Connect(const std::string& address,
                               std::optional<ReplicaTarget> target = std::nullopt) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
  args.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
  auto s = std::make_unique<Stubs>();
  s->channel = MakeChannel(address, ChannelSecurity::Plaintext(kToken), args, target);
  s->control = v1::Control::NewStub(s->channel);
  s->shard = v1::Shard::NewStub(s->channel);
  s->replica = v1::Replica::NewStub(s->channel);
  return s;
}

// The model: --params elements in 8 tensors (one a layer).
Layout MakeLayout(uint64_t params) {
  constexpr uint64_t kTensors = 8;
  std::vector<TensorSpec> tensors;
  const uint64_t each = std::max<uint64_t>(1, params / kTensors);
  uint64_t left = params;
  for (uint32_t i = 0; left > 0; ++i) {
    const uint64_t n = i + 1 == kTensors ? left : std::min(each, left);
    tensors.push_back({absl::StrCat("layer", i, ".w"), {static_cast<int64_t>(n)}, DType::kFp32, i});
    left -= n;
  }
  absl::StatusOr<Layout> layout = Layout::Create(std::move(tensors));
  Check(layout.status(), "layout");
  return *std::move(layout);
}

// What every job of the run shares: the layout, the groups' ranges, and the
// prebuilt initial parameters and pushes (every step pushes the same
// gradients, its step number set before the push).
struct Workload {
  JobSettings settings;
  Layout layout;
  JobConfig config;
  std::vector<FlatRange> group;                                    // [daemon]
  std::vector<std::vector<std::vector<v1::ParameterChunk>>> init;  // [daemon][stream]
  std::vector<std::vector<std::vector<std::vector<v1::GradientChunk>>>>
      push;                 // [daemon][rank][stream]
  uint64_t push_bytes = 0;  // payload of one step's pushes, all daemons
};

template <typename Chunk>
void AddToStreams(std::vector<std::vector<Chunk>>* streams, Chunk chunk, uint64_t* stream_bytes,
                  uint64_t limit) {
  const uint64_t held = chunk.data().size() + kPushChunkOverheadBytes;
  if (streams->empty() || *stream_bytes + held > limit) {
    streams->emplace_back();
    *stream_bytes = 0;
  }
  *stream_bytes += held;
  streams->back().push_back(std::move(chunk));
}

Workload MakeWorkload(const std::vector<std::string>& addresses) {
  Workload w;
  w.layout = MakeLayout(absl::GetFlag(FLAGS_params));
  JobSettings& s = w.settings;
  s.job_id = "replica-bench";
  s.stage = absl::GetFlag(FLAGS_stage);
  s.world_size = absl::GetFlag(FLAGS_world_size);
  s.precision = DType::kFp32;
  s.reduction = ReductionMode::kDaemon;
  s.bucket_bytes = absl::GetFlag(FLAGS_bucket_bytes);
  s.daemons = addresses;
  s.replicas = 2;
  Check(ValidateJobSettings(s, "--"), "job settings");
  absl::StatusOr<JobConfig> config = ParseJobSpec(ToJobSpec(s, w.layout));
  Check(config.status(), "job spec");
  w.config = *std::move(config);
  const uint64_t total = w.config.map.total_elements();
  const uint64_t limit = MaxPushStreamBytes(s.bucket_bytes);
  for (uint32_t d = 0; d < kDaemons; ++d) {
    w.group.push_back(w.config.map.DaemonRange(d).Intersect({0, total}));
  }
  std::vector<float> values(kChunkElements);
  w.init.resize(kDaemons);
  w.push.resize(kDaemons);
  for (uint32_t d = 0; d < kDaemons; ++d) {
    const FlatRange g = w.group[d];
    uint64_t bytes = 0;
    for (uint64_t b = g.begin; b < g.end; b += kChunkElements) {
      const uint64_t e = std::min(g.end, b + kChunkElements);
      for (uint64_t i = b; i < e; ++i) values[i - b] = 0.1f * Noise(i, 1000);
      v1::ParameterChunk c;
      c.set_job_id(s.job_id);
      c.mutable_range()->set_begin(b);
      c.mutable_range()->set_end(e);
      c.set_dtype(v1::DTYPE_FP32);
      c.set_data(values.data(), (e - b) * sizeof(float));
      c.set_crc32c(Crc32c(c.data().data(), c.data().size()));
      AddToStreams(&w.init[d], std::move(c), &bytes, limit);
    }
    absl::StatusOr<std::vector<PartitionMap::Piece>> pieces = w.config.map.Split(g);
    Check(pieces.status(), "split");
    w.push[d].resize(s.world_size);
    for (uint32_t rank = 0; rank < s.world_size; ++rank) {
      bytes = 0;
      for (const PartitionMap::Piece& piece : *pieces) {
        for (uint64_t b = piece.range.begin; b < piece.range.end; b += kChunkElements) {
          const uint64_t e = std::min(piece.range.end, b + kChunkElements);
          for (uint64_t i = b; i < e; ++i) values[i - b] = 0.01f * Noise(i, rank);
          v1::GradientChunk c;
          c.set_job_id(s.job_id);
          c.set_rank(rank);
          c.set_incarnation(kIncarnation);
          c.mutable_range()->set_begin(b);
          c.mutable_range()->set_end(e);
          c.set_dtype(v1::DTYPE_FP32);
          c.set_data(values.data(), (e - b) * sizeof(float));
          c.set_crc32c(Crc32c(c.data().data(), c.data().size()));
          w.push_bytes += c.data().size();
          AddToStreams(&w.push[d][rank], std::move(c), &bytes, limit);
        }
      }
    }
  }
  return w;
}

template <typename Chunk, typename Response, typename Open>
grpc::Status WriteAll(std::vector<Chunk>& chunks, const std::string& job_id, Open open) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  Response resp;
  auto writer = open(&ctx, &resp);
  for (Chunk& c : chunks) {
    c.set_job_id(job_id);
    if (!writer->Write(c)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

// One job's figures, [daemon][step - 1].
struct JobRun {
  std::string id;
  std::vector<std::vector<double>> prepare;
  std::vector<std::vector<double>> commit;
  std::vector<double> push_seconds;  // per step, all pushes
};

// Registers job `id` (replicas 1 or 2) on both daemons, joins every rank,
// initialises the parameters and runs 1 + --steps steps; then every rank
// leaves. With replicas = 2, checks every PrepareStep brought the backup
// along.
JobRun RunJob(Workload& w, const std::string& id, uint32_t replicas,
              const std::vector<std::unique_ptr<Daemon>>& daemons) {
  JobSettings settings = w.settings;
  settings.job_id = id;
  settings.replicas = replicas;
  const v1::JobSpec spec = ToJobSpec(settings, w.layout);
  JobRun run;
  run.id = id;
  run.prepare.resize(kDaemons);
  run.commit.resize(kDaemons);
  std::vector<std::unique_ptr<Stubs>> plain;
  std::vector<std::unique_ptr<Stubs>> target;  // group d's primary, with the replica metadata
  for (int d = 0; d < kDaemons; ++d) {
    plain.push_back(Connect(daemons[d]->address()));
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::RegisterJobRequest req;
    *req.mutable_spec() = spec;
    req.set_daemon_index(d);
    v1::RegisterJobResponse resp;
    Check(plain[d]->control->RegisterJob(&ctx, req, &resp), absl::StrCat("register ", id));
    for (uint32_t rank = 0; rank < settings.world_size; ++rank) {
      grpc::ClientContext jctx;
      SetDeadline(&jctx);
      v1::JoinJobRequest join;
      join.set_job_id(id);
      join.set_rank(rank);
      join.set_layout_fingerprint(spec.layout_fingerprint());
      join.set_stage(spec.stage());
      join.set_world_size(spec.world_size());
      join.set_precision(spec.precision());
      join.set_incarnation(kIncarnation);
      v1::JoinJobResponse jresp;
      Check(plain[d]->control->JoinJob(&jctx, join, &jresp), absl::StrCat("join rank ", rank));
    }
    if (replicas > 1) {
      // The placement as a client reads it: group d's primary and epoch.
      grpc::ClientContext sctx;
      SetDeadline(&sctx);
      v1::GetReplicaStateRequest sreq;
      sreq.set_job_id(id);
      v1::ReplicaState state;
      Check(plain[d]->replica->GetReplicaState(&sctx, sreq, &state), "GetReplicaState");
      uint64_t epoch = 0;
      for (const v1::ReplicaGroupState& g : state.groups()) {
        if (g.group() == static_cast<uint32_t>(d) && g.role() == v1::REPLICA_ROLE_PRIMARY) {
          epoch = g.epoch();
        }
      }
      if (epoch == 0) Die(absl::StrCat("daemon ", d, " is not group ", d, "'s primary"));
      target.push_back(
          Connect(daemons[d]->address(), ReplicaTarget{static_cast<uint32_t>(d), epoch}));
    } else {
      target.push_back(Connect(daemons[d]->address()));
    }
    for (std::vector<v1::ParameterChunk>& stream : w.init[d]) {
      Check(WriteAll<v1::ParameterChunk, v1::InitParametersResponse>(
                stream, id,
                [&](grpc::ClientContext* c, v1::InitParametersResponse* r) {
                  return target[d]->shard->InitParameters(c, r);
                }),
            "init");
    }
  }
  const int steps = 1 + std::max(1, absl::GetFlag(FLAGS_steps));
  for (uint64_t step = 1; step <= static_cast<uint64_t>(steps); ++step) {
    const double push_start = Now();
    for (int d = 0; d < kDaemons; ++d) {
      for (auto& rank_streams : w.push[d]) {
        for (std::vector<v1::GradientChunk>& stream : rank_streams) {
          for (v1::GradientChunk& c : stream) c.set_step(step);
          Check(WriteAll<v1::GradientChunk, v1::PushGradientResponse>(
                    stream, id,
                    [&](grpc::ClientContext* c, v1::PushGradientResponse* r) {
                      return target[d]->shard->PushGradient(c, r);
                    }),
                absl::StrCat("push of step ", step));
        }
      }
    }
    run.push_seconds.push_back(Now() - push_start);
    double sum_sq = 0;
    for (int d = 0; d < kDaemons; ++d) {
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      v1::PrepareStepRequest req;
      req.set_job_id(id);
      req.set_step(step);
      req.set_rank(0);
      req.set_incarnation(kIncarnation);
      v1::PrepareStepResponse resp;
      const double start = Now();
      Check(target[d]->shard->PrepareStep(&ctx, req, &resp),
            absl::StrCat("prepare of step ", step, " on daemon ", d));
      run.prepare[d].push_back(Now() - start);
      if (replicas > 1 && !resp.backup_in_sync()) {
        Die(absl::StrCat("job ", id, " step ", step, " group ", d,
                         ": PrepareStep answered backup_in_sync=false (the transfer or the "
                         "forward failed or timed out: see the daemon's line above); try a "
                         "smaller --params"));
      }
      sum_sq += resp.grad_sq_sum();
    }
    const float norm = static_cast<float>(std::sqrt(sum_sq));
    const float clip = std::min(1.0f, kMaxNorm / (norm + 1e-6f));
    for (int d = 0; d < kDaemons; ++d) {
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      v1::CommitStepRequest req;
      req.set_job_id(id);
      req.set_step(step);
      req.set_lr(kLr);
      req.set_clip_coef(clip);
      req.set_grad_norm(norm);
      req.set_rank(0);
      req.set_incarnation(kIncarnation);
      v1::CommitStepResponse resp;
      const double start = Now();
      Check(target[d]->shard->CommitStep(&ctx, req, &resp),
            absl::StrCat("commit of step ", step, " on daemon ", d));
      run.commit[d].push_back(Now() - start);
    }
  }
  for (int d = 0; d < kDaemons; ++d) {
    for (uint32_t rank = 0; rank < settings.world_size; ++rank) {
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      v1::LeaveRequest req;
      req.set_job_id(id);
      req.set_rank(rank);
      req.set_incarnation(kIncarnation);
      v1::LeaveResponse resp;
      Check(plain[d]->control->Leave(&ctx, req, &resp), absl::StrCat("leave rank ", rank));
    }
  }
  // Wait until both daemons freed the job (and the backups), so the next
  // one starts on the same memory.
  const double until = Now() + 30;
  for (;;) {
    bool gone = true;
    for (const auto& daemon : daemons)
      gone = gone && daemon->jobs().size() == 0 && daemon->jobs().retired() == 0;
    if (gone || Now() > until) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return run;
}

std::vector<double> Tail(const std::vector<double>& v) {
  return std::vector<double>(v.begin() + std::min<size_t>(1, v.size()), v.end());
}

int Main() {
  StderrTee tee;
  const bool capture = absl::GetFlag(FLAGS_capture_log) && tee.Start();
  if (capture) g_tee = &tee;
  if (absl::GetFlag(FLAGS_capture_log) && !capture) {
    std::fprintf(stderr, "replica_bench: could not tee stderr; the transfer is the delta figure\n");
  }

  const std::string bulk = absl::GetFlag(FLAGS_bulk_transport);
  DaemonOptions o;
  o.bulk_transport = bulk;
  o.ucx_tls = absl::GetFlag(FLAGS_ucx_tls);
  o.ucx_trust_peers = true;  // both daemons are in this process, on loopback
  o.optimizer_threads = absl::GetFlag(FLAGS_optimizer_threads);
  o.read_lease = absl::ZeroDuration();  // a removed job is freed at the next reap
  std::vector<std::unique_ptr<Daemon>> daemons;
  std::vector<std::string> addresses;
  for (int d = 0; d < kDaemons; ++d) {
    absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(o);
    Check(daemon.status(), absl::StrCat("daemon ", d));
    addresses.push_back((*daemon)->address());
    daemons.push_back(*std::move(daemon));
  }

  SinkService sink_service;
  grpc::ServerBuilder builder;
  int sink_port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &sink_port);
  builder.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
  builder.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
  builder.RegisterService(&sink_service);
  std::unique_ptr<grpc::Server> sink = builder.BuildAndStart();
  if (sink == nullptr || sink_port == 0) Die("the sink server did not start");
  const std::string sink_address = absl::StrCat("127.0.0.1:", sink_port);
  // No keepalive: the sink below is a bare server without the daemon's ping
  // policy.
  GrpcReplicaLink link{TlsFiles{}, absl::ZeroDuration()};

  Workload w = MakeWorkload(addresses);
  const uint64_t group_n[kDaemons] = {w.group[0].size(), w.group[1].size()};
  std::printf(
      "replica_bench: Ψ=%llu fp32 AdamW, stage %u, world %u, %d daemons and the leader in this "
      "process (%u CPUs), optimizer threads %d per daemon, C_B %llu B (push streams <= %llu B); "
      "groups of %llu and %llu elements (state %llu and %llu B); %d jobs x %d steps\n",
      static_cast<unsigned long long>(absl::GetFlag(FLAGS_params)), w.settings.stage,
      w.settings.world_size, kDaemons, std::thread::hardware_concurrency(),
      absl::GetFlag(FLAGS_optimizer_threads),
      static_cast<unsigned long long>(w.settings.bucket_bytes),
      static_cast<unsigned long long>(MaxPushStreamBytes(w.settings.bucket_bytes)),
      static_cast<unsigned long long>(group_n[0]), static_cast<unsigned long long>(group_n[1]),
      static_cast<unsigned long long>(kStateArrays * 4 * group_n[0]),
      static_cast<unsigned long long>(kStateArrays * 4 * group_n[1]), absl::GetFlag(FLAGS_jobs),
      1 + std::max(1, absl::GetFlag(FLAGS_steps)));
  PrintMemoryContext(kStateArrays * 4 * std::max(group_n[0], group_n[1]));
  std::fflush(stdout);

  std::unique_ptr<RawGets> raw_gets;
  if (!bulk.empty()) {
    raw_gets = std::make_unique<RawGets>(bulk, absl::GetFlag(FLAGS_ucx_tls),
                                         std::max(group_n[0], group_n[1]));
  }

  // ---- Replicated jobs: the transfers, then the raw streams ----
  std::vector<double> log_gbps, delta_gbps, raw_gbps, get_gbps;
  int bulk_transfers = 0;
  int stream_transfers = 0;
  std::vector<double> repl_prepare, repl_commit, push_gbps;
  for (int j = 0; j < std::max(1, absl::GetFlag(FLAGS_jobs)); ++j) {
    const JobRun run = RunJob(w, absl::StrCat("replica-bench-", j), 2, daemons);
    for (int d = 0; d < kDaemons; ++d) {
      const std::vector<double> later = Tail(run.prepare[d]);
      const double t_next = Median(later);
      const double delta = run.prepare[d][0] - t_next;
      const double state_bytes = static_cast<double>(kStateArrays * 4 * group_n[d]);
      delta_gbps.push_back(Gbps(state_bytes, delta));
      for (double t : later) repl_prepare.push_back(t);
      for (double t : Tail(run.commit[d])) repl_commit.push_back(t);
      std::string logged = "not captured";
      if (capture) {
        std::optional<LoggedTransfer> t = tee.Wait(run.id, d, 5.0);
        if (t.has_value()) {
          if (t->bytes != kStateArrays * 4 * group_n[d]) {
            Die(absl::StrCat("the daemon copied ", t->bytes, " bytes of group ", d, ", expected ",
                             kStateArrays * 4 * group_n[d]));
          }
          log_gbps.push_back(Gbps(t->bytes, t->seconds));
          (t->bulk ? bulk_transfers : stream_transfers)++;
          logged = absl::StrFormat(
              "%llu B in %.3f s (%.3f GB/s) %s", static_cast<unsigned long long>(t->bytes),
              t->seconds, log_gbps.back(), t->bulk ? "over the bulk transport" : "in the stream");
        }
      }
      std::printf(
          "transfer  job %d group %d: PrepareStep(1) %.3f s, later steps %.3f s (median of %zu): "
          "delta %.3f s (%.3f GB/s); daemon log: %s\n",
          j, d, run.prepare[d][0], t_next, later.size(), delta, delta_gbps.back(), logged.c_str());
    }
    for (double s : Tail(run.push_seconds)) push_gbps.push_back(Gbps(w.push_bytes, s));
    for (int d = 0; d < kDaemons; ++d) {
      for (int r = 0; r < std::max(1, absl::GetFlag(FLAGS_raw_streams)); ++r) {
        const double seconds = RawStream(link, sink_address, group_n[d]);
        raw_gbps.push_back(Gbps(kStateArrays * 4.0 * group_n[d], seconds));
        std::printf(
            "baseline  raw gRPC stream of group %d's bytes to the sink: %.3f s (%.3f GB/s)\n", d,
            seconds, raw_gbps.back());
        if (raw_gets != nullptr) {
          const double get_seconds = raw_gets->Read();
          const double state_bytes = kStateArrays * 4.0 * std::max(group_n[0], group_n[1]);
          get_gbps.push_back(Gbps(state_bytes, get_seconds));
          std::printf("transport raw %s Gets of %.0f B (a group's state): %.3f s (%.3f GB/s)\n",
                      bulk.c_str(), state_bytes, get_seconds, get_gbps.back());
        }
      }
    }
    std::fflush(stdout);
  }

  // ---- The same job without a backup ----
  const JobRun single = RunJob(w, "replica-bench-single", 1, daemons);
  std::vector<double> single_prepare, single_commit;
  for (int d = 0; d < kDaemons; ++d) {
    for (double t : Tail(single.prepare[d])) single_prepare.push_back(t);
    for (double t : Tail(single.commit[d])) single_commit.push_back(t);
  }
  for (double s : Tail(single.push_seconds)) push_gbps.push_back(Gbps(w.push_bytes, s));

  const double group_mean = (group_n[0] + group_n[1]) / 2.0;
  const double prep2 = Median(repl_prepare);
  const double prep1 = Median(single_prepare);
  const double forward_added = prep2 - prep1;
  const double forward_gbps = Gbps(4 * group_mean, forward_added);
  const double commit2 = Median(repl_commit);
  const double commit1 = Median(single_commit);
  std::printf(
      "forward   PrepareStep after step 1: replicas=2 %.4f s, replicas=1 %.4f s (medians of "
      "%zu and %zu): +%.4f s for %.0f B of gradient (%.3f GB/s)\n",
      prep2, prep1, repl_prepare.size(), single_prepare.size(), forward_added, 4 * group_mean,
      forward_gbps);
  std::printf(
      "commit    CommitStep after step 1: replicas=2 %.4f s, replicas=1 %.4f s (+%.4f s: the "
      "backup's update runs after the primary's, before the answer)\n",
      commit2, commit1, commit2 - commit1);
  std::printf("push      PushGradient streams: %.3f GB/s (median of %zu steps, %llu B each)\n",
              Median(push_gbps), push_gbps.size(), static_cast<unsigned long long>(w.push_bytes));

  const bool from_log = !log_gbps.empty();
  const double transfer = from_log ? Median(log_gbps) : Median(delta_gbps);
  const double raw = Median(raw_gbps);
  const double gets = get_gbps.empty() ? NAN : Median(get_gbps);
  const char* path = bulk_transfers > 0 && stream_transfers == 0   ? "bulk"
                     : stream_transfers > 0 && bulk_transfers == 0 ? "stream"
                     : from_log                                    ? "mixed"
                                                                   : "unknown";
  std::printf(
      "transfer_gbps=%.3f transfer_path=%s transfer_source=%s transfer_delta_gbps=%.3f "
      "grpc_stream_gbps=%.3f transport_gbps=%.3f forward_added_s=%.4f forward_gbps=%.3f\n",
      transfer, path, from_log ? "log" : "delta", Median(delta_gbps), raw, gets, forward_added,
      forward_gbps);
  if (!bulk.empty()) {
    std::printf("transfer_vs_transport=%.3f\n", transfer / gets);
  } else {
    std::printf("transfer_vs_grpc_stream=%.3f\n", transfer / raw);
  }
  std::fflush(stdout);

  sink->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  for (auto& d : daemons) d->Shutdown(absl::Seconds(5));
  tee.Stop();
  g_tee = nullptr;
  return 0;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
