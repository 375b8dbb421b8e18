// Concurrency and fencing of one job on a daemon: rank incarnations, the
// bounded out-of-order buffer, and gathers whose reader stalls.

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using testing::DaemonClient;
using testing::ExpectRejected;
using testing::GradientChunks;
using testing::MakeSpec;
using testing::SampleLayout;

std::unique_ptr<Daemon> Start(
    uint64_t reduction_buffer_bytes = DaemonOptions().reduction_buffer_bytes) {
  DaemonOptions o;
  o.reduction_buffer_bytes = reduction_buffer_bytes;
  o.read_lease = absl::ZeroDuration();
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

// Job "job" of SampleLayout() at stage 2 with `world` ranks in `precision`,
// on a daemon of its own (Start(reduction_buffer_bytes)), registered and
// every rank joined (`joined`: whether both calls succeeded).
struct JoinedJob {
  explicit JoinedJob(uint32_t world,
                     uint64_t reduction_buffer_bytes = DaemonOptions().reduction_buffer_bytes,
                     v1::DType precision = v1::DTYPE_FP32)
      : d(Start(reduction_buffer_bytes)),
        c(d->address()),
        spec(MakeSpec("job", SampleLayout(), 2, world, {d->address()})) {
    spec.set_precision(precision);
    config = *ParseJobSpec(spec);
    joined = c.Register(spec, 0).ok() && c.JoinAll(spec).ok();
  }
  std::unique_ptr<Daemon> d;
  DaemonClient c;
  v1::JobSpec spec;
  JobConfig config;
  bool joined = false;
};

// Prepares and commits step 1 of job "job" as its leader, then gathers its
// `n` parameters into *params (and the prepare result into *prepared).
void CommitFirstStep(DaemonClient& c, uint64_t n, std::vector<float>* params,
                     v1::PrepareStepResponse* prepared = nullptr) {
  v1::PrepareStepResponse p;
  ASSERT_TRUE(c.Prepare("job", 1, &p).ok());
  if (prepared != nullptr) *prepared = p;
  ASSERT_TRUE(c.Commit("job", 1, 0.01f).ok());
  ASSERT_TRUE(c.Gather("job", 1, {0, n}, params).ok());
}

void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b) {
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

// Bug 5: a second process claiming a rank fences the first; the stale
// process's pushes are refused and change nothing.
TEST(JobTest, NewerIncarnationFencesTheOlder) {
  JoinedJob job(2);
  ASSERT_TRUE(job.joined);
  std::unique_ptr<Daemon>& d = job.d;
  DaemonClient& c = job.c;
  const v1::JobSpec& spec = job.spec;
  const JobConfig& config = job.config;
  ASSERT_TRUE(c.Join(spec, 1, 5).ok());  // a restarted rank 1
  EXPECT_EQ(c.Join(spec, 1, 3).error_code(), grpc::FAILED_PRECONDITION);
  std::vector<float> g(config.map.total_elements(), 1.0f);
  auto stale = GradientChunks("job", 1, 1, config.map, {0, config.map.total_elements()}, g.data(),
                              1000);
  const uint64_t before = (*d->jobs().Find("job"))->StateHash();
  grpc::Status s = c.Push(stale);  // incarnation 1: fenced
  EXPECT_EQ(s.error_code(), grpc::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("fenced"), std::string::npos) << s.error_message();
  EXPECT_EQ((*d->jobs().Find("job"))->StateHash(), before);
  for (auto& chunk : stale) chunk.set_incarnation(5);
  EXPECT_TRUE(c.Push(stale).ok());
  v1::StepState state;
  ASSERT_TRUE(c.StepState("job", &state).ok());
  EXPECT_EQ(state.ranks_joined(), 2u);
  EXPECT_EQ(state.ranks_connected(), 2u);
  ASSERT_GT(state.missing_size(), 0);
  EXPECT_EQ(state.missing(0).rank(), 0u);  // rank 1 is in; it waits for rank 0
  ASSERT_EQ(state.ranks_size(), 2);
  EXPECT_EQ(state.ranks(1).incarnation(), 5u);
  // A brief answer has the same step fields, without the per-rank list and
  // the missing ranges.
  grpc::ClientContext ctx;
  v1::GetStepStateRequest req;
  req.set_job_id("job");
  req.set_brief(true);
  v1::StepState brief;
  ASSERT_TRUE(c.shard->GetStepState(&ctx, req, &brief).ok());
  EXPECT_EQ(brief.ranks_size(), 0);
  EXPECT_EQ(brief.missing_size(), 0);
  v1::StepState full_without_lists = state;
  full_without_lists.clear_ranks();
  full_without_lists.clear_missing();
  EXPECT_EQ(brief.SerializeAsString(), full_without_lists.SerializeAsString());
}

// Bug 6: when rank 0 is late, the others' early contributions fill a bounded
// buffer; past it pushes wait instead of growing it, and the result is
// bit-identical to in-order arrival.
TEST(JobTest, OutOfOrderBufferIsBoundedAndExact) {
  constexpr uint32_t kWorld = 4;
  std::vector<float> in_order, out_of_order;
  v1::PrepareStepResponse prepared[2];
  double expected_sq_sum = 0;
  for (int pass = 0; pass < 2; ++pass) {
    const uint64_t budget = 16 << 10;  // a few chunks of fp32
    JoinedJob job(kWorld, budget);
    ASSERT_TRUE(job.joined);
    std::unique_ptr<Daemon>& d = job.d;
    DaemonClient& c = job.c;
    const JobConfig& config = job.config;
    const uint64_t n = config.map.total_elements();
    std::vector<std::vector<float>> grads(kWorld, std::vector<float>(n));
    for (uint32_t r = 0; r < kWorld; ++r) {
      for (uint64_t i = 0; i < n; ++i) grads[r][i] = 0.1f * (r + 1) + 1e-3f * (i % 97);
    }
    uint64_t peak = 0;
    std::atomic<bool> done{false};
    std::thread watch([&] {
      while (!done) {
        peak = std::max<uint64_t>(
            peak, d->ledger().JobBytes("job")[static_cast<int>(MemoryCategory::kBuffer)]);
        absl::SleepFor(absl::Microseconds(200));
      }
    });
    std::vector<std::thread> ranks;
    std::vector<grpc::Status> results(kWorld);
    auto push = [&](uint32_t r) {
      results[r] = c.Push(GradientChunks("job", 1, r, config.map, {0, n}, grads[r].data(), 512));
    };
    if (pass == 0) {
      for (uint32_t r = 0; r < kWorld; ++r) push(r);
    } else {
      for (uint32_t r = kWorld - 1; r >= 1; --r) ranks.emplace_back(push, r);
      absl::SleepFor(absl::Milliseconds(300));  // ranks 1..3 fill the buffer and wait
      push(0);
      for (auto& t : ranks) t.join();
    }
    done = true;
    watch.join();
    for (uint32_t r = 0; r < kWorld; ++r) ASSERT_TRUE(results[r].ok()) << results[r].error_message();
    // Chunks of 512 fp32 are 2 KiB; the out-of-order buffer never holds more
    // than its budget. `buffer` also books each push stream while the daemon
    // holds it (every rank's whole gradient, 256 bytes counted per chunk).
    const uint64_t streams = kWorld * (n * sizeof(float) + (n / 512 + kWorld) * 256);
    EXPECT_LE(peak, budget + streams);
    ASSERT_NO_FATAL_FAILURE(
        CommitFirstStep(c, n, pass == 0 ? &in_order : &out_of_order, &prepared[pass]));
    if (pass == 0) {
      // The norm of the mean gradient, computed here the plain way.
      for (uint64_t i = 0; i < n; ++i) {
        float sum = 0;
        for (uint32_t r = 0; r < kWorld; ++r) sum += grads[r][i];
        const double x = sum * (1.0f / kWorld);
        expected_sq_sum += x * x;
      }
    }
  }
  ExpectSameBits(in_order, out_of_order);
  // The squared norm is taken in each range's last contribution pass, in
  // whichever order the contributions came: the same bits either way.
  EXPECT_NEAR(prepared[0].grad_sq_sum(), expected_sq_sum, expected_sq_sum * 1e-9);
  const double a = prepared[0].grad_sq_sum(), b = prepared[1].grad_sq_sum();
  EXPECT_EQ(0, std::memcmp(&a, &b, sizeof(double))) << a << " vs " << b;
  EXPECT_FALSE(prepared[1].found_inf_nan());
}

// Daemon reduction: a chunk may span several of the daemon's partitions (a
// client cuts a rank's gradient for a daemon by C_B alone). One chunk per
// rank across all four partitions sums to the bits of per-partition chunks.
TEST(JobTest, DaemonReductionSumsChunksAcrossPartitions) {
  constexpr uint32_t kWorld = 4;
  std::vector<float> params[2];
  v1::PrepareStepResponse prepared[2];
  for (int pass = 0; pass < 2; ++pass) {
    JoinedJob job(kWorld);
    ASSERT_TRUE(job.joined);
    DaemonClient& c = job.c;
    const JobConfig& config = job.config;
    const uint64_t n = config.map.total_elements();
    ASSERT_GT(n, config.map.partition_elements());  // the whole range spans partitions
    for (uint32_t r = 0; r < kWorld; ++r) {
      std::vector<float> g(n);
      for (uint64_t i = 0; i < n; ++i) g[i] = 0.1f * (r + 1) + 1e-3f * (i % 97);
      std::vector<v1::GradientChunk> chunks =
          GradientChunks("job", 1, r, config.map, {0, n}, g.data(), n);
      if (pass == 1) {
        v1::GradientChunk whole = chunks[0];
        whole.mutable_range()->set_end(n);
        whole.set_data(std::string(reinterpret_cast<const char*>(g.data()), n * sizeof(float)));
        whole.set_crc32c(0);
        chunks = {whole};
      }
      ASSERT_EQ(chunks.size() == 1, pass == 1);
      const grpc::Status s = c.Push(chunks);
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
    ASSERT_NO_FATAL_FAILURE(CommitFirstStep(c, n, &params[pass], &prepared[pass]));
  }
  ExpectSameBits(params[0], params[1]);
  EXPECT_NEAR(prepared[0].grad_sq_sum(), prepared[1].grad_sq_sum(),
              prepared[0].grad_sq_sum() * 1e-12);
}

// A rank's process dies in the middle of a step and a new one replays it:
// what the old one left in the out-of-order buffer is dropped at the join,
// what it had applied is kept, and the new one's pushes of those are
// answered ALREADY_EXISTS: compared by CRC-32C where the held push carried
// one (computed from the new chunk when it carries none, as a staged push
// does; other bytes are refused), kept uncompared where it carried none. A
// rank that was not replaced gets no such pass. The step ends with the
// parameters of a run where nothing failed.
TEST(JobTest, RestartedRankReplaysTheOpenStep) {
  constexpr uint32_t kWorld = 3;
  std::vector<std::vector<float>> params(2);
  for (int pass = 0; pass < 2; ++pass) {
    JoinedJob job(kWorld);
    ASSERT_TRUE(job.joined);
    std::unique_ptr<Daemon>& d = job.d;
    DaemonClient& c = job.c;
    const v1::JobSpec& spec = job.spec;
    const JobConfig& config = job.config;
    const uint64_t n = config.map.total_elements();
    const uint64_t half = n / 2;
    std::vector<std::vector<float>> grads(kWorld, std::vector<float>(n));
    for (uint32_t r = 0; r < kWorld; ++r) {
      for (uint64_t i = 0; i < n; ++i) grads[r][i] = 0.25f * (r + 1) - 1e-3f * (i % 89);
    }
    // Rank r's chunks of `range`; every other one without a CRC-32C (staged).
    auto chunks = [&](uint32_t r, FlatRange range, uint64_t incarnation) {
      std::vector<v1::GradientChunk> cs =
          GradientChunks("job", 1, r, config.map, range, grads[r].data() + range.begin, 256);
      for (size_t i = 0; i < cs.size(); ++i) {
        cs[i].set_incarnation(incarnation);
        if (i % 2 == 1) cs[i].clear_crc32c();
      }
      return cs;
    };
    auto push_each = [&](const std::vector<v1::GradientChunk>& cs, grpc::StatusCode code) {
      for (const auto& chunk : cs) {
        const grpc::Status s = c.Push({chunk});
        ASSERT_EQ(s.error_code(), code) << s.error_message();
      }
    };
    if (pass == 0) {
      for (uint32_t r = 0; r < kWorld; ++r) push_each(chunks(r, {0, n}, 1), grpc::OK);
    } else {
      // Rank 1's first process pushes everything ahead of rank 0: buffered.
      push_each(chunks(1, {0, n}, 1), grpc::OK);
      const uint64_t buffered_before =
          d->ledger().JobBytes("job")[static_cast<int>(MemoryCategory::kBuffer)];
      // Rank 0's first half drains rank 1's first half into the sum.
      push_each(chunks(0, {0, half}, 1), grpc::OK);
      // Rank 0 was not replaced: its duplicate without a CRC-32C of a chunk
      // held without one cannot be compared, and is refused.
      ExpectRejected(*d, "job", grpc::FAILED_PRECONDITION, "cannot be compared", [&] {
        return c.Push({chunks(0, {0, half}, 1)[1]});
      });
      // Rank 1 restarts: its buffered second half is dropped.
      v1::JoinJobResponse joined;
      ASSERT_TRUE(c.Join(spec, 1, 7, &joined).ok());
      EXPECT_EQ(joined.replaced_incarnation(), 1u);
      EXPECT_EQ(joined.committed_step(), 0u);
      EXPECT_EQ(joined.dropped_contributions(), chunks(1, {half, n}, 1).size());
      EXPECT_LT(d->ledger().JobBytes("job")[static_cast<int>(MemoryCategory::kBuffer)],
                buffered_before);
      // The old process is fenced.
      push_each(chunks(1, {half, n}, 1), grpc::FAILED_PRECONDITION);
      // The new one's replay of the applied half, as staged pushes (no CRC):
      // equal to what is held, or held without a CRC.
      std::vector<v1::GradientChunk> replay = chunks(1, {0, half}, 7);
      for (auto& chunk : replay) chunk.clear_crc32c();
      push_each(replay, grpc::ALREADY_EXISTS);
      // Other bytes for a chunk held with a CRC-32C are refused and change
      // nothing, with or without a CRC of their own.
      std::vector<float> other = grads[1];
      other[0] += 1.0f;
      std::vector<v1::GradientChunk> wrong =
          GradientChunks("job", 1, 1, config.map, {0, 256}, other.data(), 256);
      wrong[0].set_incarnation(7);
      ExpectRejected(*d, "job", grpc::FAILED_PRECONDITION, "other bytes",
                     [&] { return c.Push({wrong[0]}); });
      wrong[0].clear_crc32c();
      ExpectRejected(*d, "job", grpc::FAILED_PRECONDITION, "other bytes",
                     [&] { return c.Push({wrong[0]}); });
      // The dropped half is pushed again by the new process.
      push_each(chunks(1, {half, n}, 7), grpc::OK);
      push_each(chunks(0, {half, n}, 1), grpc::OK);
      push_each(chunks(2, {0, n}, 1), grpc::OK);
    }
    ASSERT_NO_FATAL_FAILURE(CommitFirstStep(c, n, &params[pass]));
  }
  ExpectSameBits(params[0], params[1]);
}

// A bf16 job: a contribution that waits for its turn is kept in bf16, so
// the out-of-order buffer books its wire bytes (2 per element, not 4), and
// the sum equals in-order arrival bit for bit.
TEST(JobTest, OutOfOrderBf16WaitsInItsWireBytes) {
  constexpr uint32_t kWorld = 2;
  std::vector<std::vector<float>> params(2);
  for (int pass = 0; pass < 2; ++pass) {
    JoinedJob job(kWorld, DaemonOptions().reduction_buffer_bytes, v1::DTYPE_BF16);
    ASSERT_TRUE(job.joined);
    std::unique_ptr<Daemon>& d = job.d;
    DaemonClient& c = job.c;
    const JobConfig& config = job.config;
    const uint64_t n = config.map.total_elements();
    // Rank r's chunks, converted to bf16 (no CRC: the bytes change).
    auto chunks = [&](uint32_t r) {
      std::vector<float> g(n);
      for (uint64_t i = 0; i < n; ++i) g[i] = 0.5f * (r + 1) + 1e-2f * (i % 31);
      std::vector<v1::GradientChunk> cs =
          GradientChunks("job", 1, r, config.map, {0, n}, g.data(), 512);
      for (auto& chunk : cs) {
        const std::string& f32 = chunk.data();
        std::string half(f32.size() / 2, '\0');
        for (size_t i = 0; i < f32.size() / 4; ++i) {
          float v;
          std::memcpy(&v, f32.data() + 4 * i, 4);
          const uint16_t h = FloatToBf16(v);
          std::memcpy(&half[2 * i], &h, 2);
        }
        chunk.set_data(half);
        chunk.set_dtype(v1::DTYPE_BF16);
        chunk.clear_crc32c();
      }
      return cs;
    };
    if (pass == 0) {
      ASSERT_TRUE(c.Push(chunks(0)).ok());
      ASSERT_TRUE(c.Push(chunks(1)).ok());
    } else {
      const uint64_t before =
          d->ledger().JobBytes("job")[static_cast<int>(MemoryCategory::kBuffer)];
      ASSERT_TRUE(c.Push(chunks(1)).ok());  // ahead of its turn: buffered
      const uint64_t buffered =
          d->ledger().JobBytes("job")[static_cast<int>(MemoryCategory::kBuffer)] - before;
      EXPECT_GE(buffered, n * 2);
      // Beyond the wire bytes, each chunk's bookkeeping: a key and a waiting
      // entry (416 B as reduction.h charges them).
      EXPECT_LT(buffered, n * 2 + (n / 512 + 8) * 450) << "more than the wire bytes booked";
      ASSERT_TRUE(c.Push(chunks(0)).ok());
    }
    ASSERT_NO_FATAL_FAILURE(CommitFirstStep(c, n, &params[pass]));
  }
  ExpectSameBits(params[0], params[1]);
}

// A client that opens a Gather and stops reading delays nobody: another job
// on the same daemon completes 20 steps and Admin.Status answers within 1 s
// throughout.
TEST(JobTest, StalledReaderStallsNobody) {
  std::unique_ptr<Daemon> d = Start();
  const Layout big = *Layout::Create({{"w", {4 << 20}, DType::kFp32, 0}});
  DaemonClient stalled(d->address());
  const v1::JobSpec slow = MakeSpec("slow", big, 2, 1, {d->address()});
  ASSERT_TRUE(stalled.Register(slow, 0).ok());
  ASSERT_TRUE(stalled.JoinAll(slow).ok());
  // A 16 MiB gather whose reader never reads: the server blocks in Write.
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::GatherRequest req;
  req.set_job_id("slow");
  req.mutable_range()->set_end(4 << 20);
  req.set_dtype(v1::DTYPE_FP32);
  std::unique_ptr<grpc::ClientReader<v1::ParameterChunk>> reader =
      stalled.shard->Gather(&ctx, req);
  absl::SleepFor(absl::Milliseconds(200));

  DaemonClient c(d->address());
  const v1::JobSpec spec = MakeSpec("job", SampleLayout(), 2, 1, {d->address()});
  const JobConfig config = *ParseJobSpec(spec);
  ASSERT_TRUE(c.Register(spec, 0).ok());
  ASSERT_TRUE(c.JoinAll(spec).ok());
  std::vector<float> g(config.map.total_elements(), 0.5f);
  // The promise is 1 s; the call's own deadline is well past it, so a slow
  // answer fails the timing check below, not the call.
  constexpr absl::Duration kStatusBound = absl::Seconds(1);
  absl::Duration slowest_status;
  for (uint64_t step = 1; step <= 20; ++step) {
    ASSERT_TRUE(c.Push(GradientChunks("job", step, 0, config.map,
                                      {0, config.map.total_elements()}, g.data(), 4096))
                    .ok());
    v1::PrepareStepResponse p;
    ASSERT_TRUE(c.Prepare("job", step, &p).ok());
    ASSERT_TRUE(c.Commit("job", step, 0.01f).ok());
    const absl::Time t0 = absl::Now();
    grpc::ClientContext sctx;
    sctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::StatusResponse status;
    const grpc::Status s = c.admin->Status(&sctx, v1::StatusRequest(), &status);
    const absl::Duration took = absl::Now() - t0;
    ASSERT_TRUE(s.ok()) << s.error_message() << " after " << took;
    ASSERT_LT(took, kStatusBound) << "Admin.Status at step " << step
                                  << " waited for the stalled reader";
    slowest_status = std::max(slowest_status, took);
    // Both jobs are in the answer: the stalled one is read, not skipped.
    ASSERT_EQ(status.jobs_size(), 2);
  }
  std::vector<float> slow_grad(4 << 20, 0.25f);
  ASSERT_TRUE(stalled.Push(GradientChunks("slow", 1, 0, *PartitionMap::Create(4 << 20, 1, 1),
                                          {0, 4 << 20}, slow_grad.data(), 1 << 20))
                  .ok());
  // The stalled job's own commit must not wait for its stalled reader
  // either (DaemonClient::Commit's deadline is 30 s, past this bound).
  v1::PrepareStepResponse p;
  ASSERT_TRUE(stalled.Prepare("slow", 1, &p).ok());
  const absl::Time t0 = absl::Now();
  ASSERT_TRUE(stalled.Commit("slow", 1, 0.01f).ok());
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5)) << "the commit waited for the stalled reader";
  RecordProperty("slowest_status_ms", std::to_string(absl::ToInt64Milliseconds(slowest_status)));
  ctx.TryCancel();
}

}  // namespace
}  // namespace zeroshard
