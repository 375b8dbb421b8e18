// The client's memory is C_B-bounded: its gradient staging pool is the same
// for a 10M- and a 50M-parameter model, and does not grow while it runs.
// (Separate from client_test: the large model makes it slow.)

#include <cstdio>
#include <memory>
#include <vector>

#include "client/client.h"
#include "gtest/gtest.h"
#include "server/daemon.h"

namespace zeroshard {
namespace {

TEST(ClientMemoryTest, StagingMemoryDoesNotGrowWithTheModel) {
  uint64_t staging[2];
  const int64_t sizes[2] = {10'000'000, 50'000'000};
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start({});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    const Layout layout = *Layout::Create({{"w", {sizes[i]}, DType::kFp32, 0},
                                           {"b", {1001}, DType::kFp32, 1}});
    const uint64_t total = layout.total_elements();
    ClientConfig config;
    config.job_token = "client-memory-test-token";
    config.daemons = {(*daemon)->address()};
    config.job_id = "big";
    config.stage = 2;
    config.precision = DType::kFp32;
    config.bucket_bytes = 32ull << 20;  // the default C_B
    config.rpc_timeout = absl::Seconds(30);
    config.step_timeout = absl::Seconds(60);
    std::vector<float> values(total, 0.5f);
    absl::StatusOr<std::unique_ptr<Client>> created = Client::Create(config);
    ASSERT_TRUE(created.ok()) << created.status();
    Client* client = created->get();
    ASSERT_TRUE(client->RegisterModel(layout, values.data()).ok());
    staging[i] = client->MemoryReport().total();
    EXPECT_EQ(client->MemoryReport().buffer, staging[i]);
    ASSERT_TRUE(client->PushGradients({0, total}, values.data(), DType::kFp32).ok());
    absl::StatusOr<StepResult> r = client->Step(1e-3f);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(client->GatherAll(values.data(), DType::kFp32).ok());
    const ClientTrafficReport t = client->TrafficReport();
    EXPECT_EQ(t.last_step.push, total * 4);
    EXPECT_EQ(t.current.gather, total * 4);
    EXPECT_EQ(client->MemoryReport().total(), staging[i]);  // nothing grew
    std::printf("Ψ=%lld: client staging %llu B (= %u buffers x C_B %llu B), pushed %llu B\n",
                static_cast<long long>(sizes[i] + 1001),
                static_cast<unsigned long long>(staging[i]), config.staging_buffers,
                static_cast<unsigned long long>(config.bucket_bytes),
                static_cast<unsigned long long>(t.last_step.push));
  }
  EXPECT_EQ(staging[0], 4 * (32ull << 20));
  EXPECT_EQ(staging[1], staging[0]);
}

}  // namespace
}  // namespace zeroshard
