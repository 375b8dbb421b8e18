#include "client/stream_data_path.h"

#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "client/rpc.h"
#include "gtest/gtest.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using testing::DaemonClient;
using testing::MakeSpec;
using testing::SampleLayout;
using testing::StartDaemon;
using testing::kTestIncarnation;

absl::Time Soon() { return absl::Now() + absl::Seconds(10); }

// A daemon with job "dp" (stage 2, one rank, joined) and a stream path to it.
class StreamDataPathJobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = StartDaemon();
    control_ = std::make_unique<DaemonClient>(daemon_->address());
    const v1::JobSpec spec = MakeSpec("dp", SampleLayout(), 2, 1, {daemon_->address()});
    ASSERT_TRUE(control_->Register(spec, 0).ok());
    ASSERT_TRUE(control_->Join(spec, 0).ok());
    path_ = std::make_unique<StreamDataPath>(
        daemon_->address(),
        MakeDaemonChannel(daemon_->address(), ChannelSecurity::Plaintext(testing::kTestToken)));
  }

  const uint64_t n_ = SampleLayout().total_elements();
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<DaemonClient> control_;
  std::unique_ptr<StreamDataPath> path_;
};

TEST_F(StreamDataPathJobTest, InitPushGather) {
  const uint64_t n = n_;
  DaemonClient& control = *control_;
  StreamDataPath& path = *path_;
  EXPECT_STREQ(path.name(), "stream");
  std::vector<float> params(n);
  for (uint64_t i = 0; i < n; ++i) params[i] = 0.25f * static_cast<float>(i % 17);
  absl::StatusOr<uint64_t> sent =
      path.InitParameters({"dp", 0, {0, n}, params.data()}, Soon());
  ASSERT_TRUE(sent.ok()) << sent.status();
  EXPECT_EQ(*sent, n * 4);

  std::vector<float> got(n);
  GatherRequestSpec g{"dp", 0, kTestIncarnation, 0, {0, n}, DType::kFp32, absl::ZeroDuration()};
  absl::StatusOr<uint64_t> received = path.Gather(g, got.data(), Soon());
  ASSERT_TRUE(received.ok()) << received.status();
  EXPECT_EQ(*received, n * 4);
  EXPECT_EQ(0, std::memcmp(got.data(), params.data(), n * 4));

  // A gather of a step not committed yet waits for it, up to `wait`.
  g.after_step = 1;
  g.wait = absl::Milliseconds(100);
  EXPECT_EQ(path.Gather(g, got.data(), Soon()).status().code(),
            absl::StatusCode::kDeadlineExceeded);

  // One push covering the whole flat space (one partition), then a step.
  std::vector<float> grad(n, 0.5f);
  GradientPush push{"dp", 1, 0, kTestIncarnation, 0, 1, {0, n}, DType::kFp32, grad.data()};
  absl::StatusOr<uint64_t> pushed = path.PushGradient(push, Soon());
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(*pushed, n * 4);
  // The same bytes again: the daemon holds them (same CRC-32C), so the push
  // is delivered. Other bytes for the same contribution are refused.
  pushed = path.PushGradient(push, Soon());
  EXPECT_TRUE(pushed.ok()) << pushed.status();
  std::vector<float> other(n, 0.75f);
  push.data = other.data();
  EXPECT_EQ(path.PushGradient(push, Soon()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  v1::PrepareStepResponse prep;
  ASSERT_TRUE(control.Prepare("dp", 1, &prep).ok());
  ASSERT_TRUE(control.Commit("dp", 1, 0.1f).ok());
  g.after_step = 1;
  ASSERT_TRUE(path.Gather(g, got.data(), Soon()).ok());
  EXPECT_NE(0, std::memcmp(got.data(), params.data(), n * 4));
}

// Several contributions in one stream: applied as one batch. Sent again
// with one more, the daemon refuses the batch (it holds some): each is then
// sent alone, the held ones are delivered and the new one applied; one with
// other bytes fails alone.
TEST_F(StreamDataPathJobTest, PushGradientsSendsOneBatch) {
  const uint64_t n = n_;
  DaemonClient& control = *control_;
  StreamDataPath& path = *path_;
  std::vector<float> grad(n, 0.5f);
  const uint64_t q = n / 4;
  auto push = [&](uint64_t begin, uint64_t end, const float* data) {
    return GradientPush{"dp", 1, 0, kTestIncarnation, 0, 1, {begin, end}, DType::kFp32, data};
  };
  std::vector<GradientPush> first = {push(0, q, grad.data()), push(q, 2 * q, grad.data() + q)};
  std::vector<absl::StatusOr<uint64_t>> sent = path.PushGradients(first, Soon());
  ASSERT_EQ(sent.size(), 2u);
  for (const auto& r : sent) ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*sent[1], q * 4);

  std::vector<float> other(n, 0.75f);
  std::vector<GradientPush> again = first;
  again.push_back(push(2 * q, 3 * q, grad.data() + 2 * q));
  again.push_back(push(0, q, other.data()));  // other bytes for a held one
  sent = path.PushGradients(again, Soon());
  ASSERT_EQ(sent.size(), 4u);
  EXPECT_TRUE(sent[0].ok()) << sent[0].status();
  EXPECT_TRUE(sent[1].ok()) << sent[1].status();
  EXPECT_TRUE(sent[2].ok()) << sent[2].status();
  EXPECT_EQ(sent[3].status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(path.PushGradient(push(3 * q, n, grad.data() + 3 * q), Soon()).ok());
  v1::PrepareStepResponse prep;
  ASSERT_TRUE(control.Prepare("dp", 1, &prep).ok()) << "every element pushed exactly once";
}

TEST(StreamDataPathTest, ErrorsNameTheDaemon) {
  auto daemon = StartDaemon();
  const std::string address = daemon->address();
  StreamDataPath path(address,
                      MakeDaemonChannel(address, ChannelSecurity::Plaintext(testing::kTestToken)));
  std::vector<float> buf(16);
  GatherRequestSpec g{"nope", 0, kTestIncarnation, 0, {0, 16}, DType::kFp32,
                      absl::ZeroDuration()};
  absl::Status s = path.Gather(g, buf.data(), Soon()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(s.message(), address)) << s;

  daemon->Shutdown(absl::ZeroDuration());
  daemon.reset();
  const absl::Time start = absl::Now();
  s = path.Gather(g, buf.data(), Soon()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), address)) << s;
  GradientPush push{"nope", 1, 0, kTestIncarnation, 0, 1, {0, 16}, DType::kFp32, buf.data()};
  s = path.PushGradient(push, Soon()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), address)) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace zeroshard
