#include "transport/transport.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace zeroshard::transport {
namespace {

TEST(RegionDescriptorTest, EncodeDecodeRoundTrip) {
  RegionDescriptor d{0x7f0012345678, 1 << 20, std::string("k\0ey", 4)};
  absl::StatusOr<RegionDescriptor> back =
      DecodeRegionDescriptor(EncodeRegionDescriptor(d));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->address, d.address);
  EXPECT_EQ(back->length, d.length);
  EXPECT_EQ(back->rkey, d.rkey);
}

TEST(RegionDescriptorTest, DecodeRejectsMalformedBytes) {
  const std::string good = EncodeRegionDescriptor({1, 2, "rkey"});
  EXPECT_TRUE(absl::IsInvalidArgument(DecodeRegionDescriptor("").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      DecodeRegionDescriptor("XXXX" + good.substr(4)).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      DecodeRegionDescriptor(good.substr(0, good.size() - 1)).status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(DecodeRegionDescriptor(good + "x").status()));
}

TEST(CheckRangeTest, AcceptsInsideAndRejectsOutside) {
  const RegionDescriptor d{4096, 100, ""};
  EXPECT_TRUE(CheckRange(d, 0, 100, "t").ok());
  EXPECT_TRUE(CheckRange(d, 100, 0, "t").ok());
  EXPECT_TRUE(CheckRange(d, 99, 1, "t").ok());
  EXPECT_TRUE(absl::IsInvalidArgument(CheckRange(d, 99, 2, "t")));
  EXPECT_TRUE(absl::IsInvalidArgument(CheckRange(d, 101, 0, "t")));
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  EXPECT_TRUE(absl::IsInvalidArgument(CheckRange(d, max, 2, "t")));
  EXPECT_TRUE(absl::IsInvalidArgument(CheckRange(d, 50, max, "t")));
  EXPECT_TRUE(
      absl::IsInvalidArgument(CheckRange({max - 10, 100, ""}, 0, 1, "t")));
  EXPECT_NE(CheckRange(d, 99, 2, "my op").message().find("my op"),
            absl::string_view::npos);
}

TEST(CompletionTest, EmptyAndReadyHandles) {
  Completion empty;
  EXPECT_TRUE(empty.IsDone());
  EXPECT_EQ(empty.Wait(absl::InfinitePast()), absl::OkStatus());
  Completion failed = Completion::Ready(absl::UnavailableError("gone"));
  EXPECT_TRUE(failed.IsDone());
  EXPECT_TRUE(absl::IsUnavailable(failed.Wait(absl::InfinitePast())));
  EXPECT_TRUE(
      absl::IsUnavailable(failed.Wait(absl::InfinitePast())));  // repeatable
}

TEST(CompletionTest, WaitHonoursDeadlineAndSeesLaterFinish) {
  auto state = std::make_shared<CompletionState>();
  Completion completion(state);
  const absl::Time start = absl::Now();
  EXPECT_TRUE(absl::IsDeadlineExceeded(
      completion.Wait(start + absl::Milliseconds(20))));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(19));
  std::thread finisher([state] {
    absl::SleepFor(absl::Milliseconds(10));
    state->Finish(absl::OkStatus());
    state->Finish(absl::InternalError("ignored: only the first Finish counts"));
  });
  EXPECT_EQ(completion.Wait(absl::Now() + absl::Seconds(10)), absl::OkStatus());
  finisher.join();
}

class AbortRecorder : public CompletionState {
 public:
  int aborts = 0;

 protected:
  void OnAbort() override {
    ++aborts;
    Finish(absl::CancelledError("aborted"));
  }
};

TEST(CompletionTest, AbortRunsHookOnceAndNotAfterDone) {
  auto state = std::make_shared<AbortRecorder>();
  Completion completion(state);
  completion.Abort();
  completion.Abort();
  EXPECT_EQ(state->aborts, 1);
  EXPECT_TRUE(absl::IsCancelled(completion.Wait(absl::InfinitePast())));

  auto done = std::make_shared<AbortRecorder>();
  done->Finish(absl::OkStatus());
  Completion finished(done);
  finished.Abort();
  EXPECT_EQ(done->aborts, 0);
  EXPECT_EQ(finished.Wait(absl::InfinitePast()), absl::OkStatus());
}

TEST(CompletionTest, DroppingAPendingHandleAbortsIt) {
  auto state = std::make_shared<AbortRecorder>();
  { Completion completion(state); }
  EXPECT_EQ(state->aborts, 1);
  EXPECT_TRUE(state->IsDone());

  auto reassigned = std::make_shared<AbortRecorder>();
  Completion handle(reassigned);
  handle = Completion::Ready(absl::OkStatus());
  EXPECT_EQ(reassigned->aborts, 1);
}

class FakeTransport : public Transport {
 public:
  explicit FakeTransport(std::string tls) : tls_(std::move(tls)) {}
  absl::string_view kind() const override { return "fake"; }
  absl::StatusOr<std::unique_ptr<Region>> RegisterRegion(void*, size_t,
                                                         Access) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<std::unique_ptr<Region>> AllocateRegion(size_t,
                                                         Access) override {
    return absl::UnimplementedError("fake");
  }
  const std::string& LocalAddress() const override { return tls_; }
  absl::StatusOr<std::unique_ptr<Connection>> Connect(absl::string_view,
                                                      absl::Time) override {
    return absl::UnimplementedError("fake");
  }

 private:
  std::string tls_;
};

TEST(RegistryTest, CreatesByNameAndRejectsUnknownOrDuplicate) {
  ASSERT_TRUE(RegisterTransportFactory(
                  "fake",
                  [](const TransportOptions& options)
                      -> absl::StatusOr<std::unique_ptr<Transport>> {
                    return std::make_unique<FakeTransport>(options.ucx_tls);
                  })
                  .ok());
  EXPECT_TRUE(absl::IsAlreadyExists(RegisterTransportFactory("fake", nullptr)));

  TransportOptions options;
  options.ucx_tls = "passed through";
  auto transport = CreateTransport("fake", options);
  ASSERT_TRUE(transport.ok()) << transport.status();
  EXPECT_EQ((*transport)->kind(), "fake");
  EXPECT_EQ((*transport)->LocalAddress(), "passed through");

  const absl::Status missing = CreateTransport("nope").status();
  EXPECT_TRUE(absl::IsNotFound(missing));
  EXPECT_NE(missing.message().find("fake"),
            absl::string_view::npos);  // lists names

  options.progress_threads = 0;
  EXPECT_TRUE(
      absl::IsInvalidArgument(CreateTransport("fake", options).status()));

  const std::vector<std::string> names = RegisteredTransports();
  EXPECT_NE(std::find(names.begin(), names.end(), "fake"), names.end());
}

}  // namespace
}  // namespace zeroshard::transport
