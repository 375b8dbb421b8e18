#include "transport/transport.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
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

TEST(AllowsTest, ChecksEveryNeededBit) {
  EXPECT_TRUE(Allows(Access::kRemoteReadWrite, Access::kRemoteRead));
  EXPECT_TRUE(Allows(Access::kRemoteReadWrite, Access::kRemoteWrite));
  EXPECT_TRUE(Allows(Access::kRemoteRead, Access::kRemoteRead));
  EXPECT_FALSE(Allows(Access::kRemoteRead, Access::kRemoteWrite));
  EXPECT_FALSE(Allows(Access::kRemoteWrite, Access::kRemoteRead));
  EXPECT_FALSE(Allows(Access::kRemoteRead, Access::kRemoteReadWrite));
}

// Records what reaches the backend's hooks; its key is "good".
class RecordingConnection : public CheckedConnection {
 public:
  RecordingConnection() : CheckedConnection("rec") {}
  const std::string& peer_name() const override { return name_; }

  std::vector<Request> issued;
  std::vector<std::string> keys;  // Request::key, copied
  mutable int key_checks = 0;
  bool refuse_issue = false;
  std::shared_ptr<CompletionState> marker;  // IssueFlush's, if set

 private:
  absl::StatusOr<absl::string_view> CheckKey(
      const RegionDescriptor& remote, absl::string_view what) const override {
    ++key_checks;
    if (remote.rkey != "good") {
      return absl::InvalidArgumentError(absl::StrCat(what, ": bad key"));
    }
    return absl::string_view(remote.rkey).substr(1, 2);
  }
  Completion Issue(const Request& request) override {
    if (refuse_issue) {
      return Completion::Ready(absl::FailedPreconditionError("shut down"));
    }
    issued.push_back(request);
    keys.emplace_back(request.key);
    return Completion::Ready(absl::OkStatus());
  }
  absl::StatusOr<std::shared_ptr<CompletionState>> IssueFlush() override {
    if (marker == nullptr) return absl::FailedPreconditionError("shut down");
    return marker;
  }

  std::string name_ = "peer";
};

TEST(CheckedConnectionTest, ChecksInOrderThenIssues) {
  RecordingConnection c;
  const RegionDescriptor good{4096, 100, "good"};
  const RegionDescriptor bad_key{4096, 100, "evil"};
  char buffer[100] = {};

  // Range first, before the key is looked at.
  absl::Status status = c.Put(buffer, 10, bad_key, 95).Wait(absl::Now());
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_NE(status.message().find("rec put"), absl::string_view::npos);
  EXPECT_EQ(c.key_checks, 0);
  // Then the key, even for length 0 or a null buffer.
  status = c.Get(nullptr, 0, bad_key, 0).Wait(absl::Now());
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_NE(status.message().find("rec get: bad key"), absl::string_view::npos);
  // Length 0 is done, with nothing issued, even with a null buffer.
  EXPECT_EQ(c.Put(nullptr, 0, good, 100).Wait(absl::Now()), absl::OkStatus());
  // A null buffer with bytes to move.
  status = c.Get(nullptr, 1, good, 0).Wait(absl::Now());
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_NE(status.message().find("null buffer"), absl::string_view::npos);
  EXPECT_TRUE(c.issued.empty());

  EXPECT_EQ(c.Put(buffer, 10, good, 90).Wait(absl::Now()), absl::OkStatus());
  EXPECT_EQ(c.Get(buffer + 1, 3, good, 7).Wait(absl::Now()), absl::OkStatus());
  ASSERT_EQ(c.issued.size(), 2u);
  EXPECT_EQ(c.issued[0].kind, CheckedConnection::Kind::kPut);
  EXPECT_EQ(c.issued[0].local, buffer);
  EXPECT_EQ(c.issued[0].length, 10u);
  EXPECT_EQ(c.issued[0].offset, 90u);
  EXPECT_EQ(c.issued[0].remote_address, 4096u + 90);
  EXPECT_EQ(c.keys[0], "oo");  // what CheckKey returned
  EXPECT_EQ(c.issued[1].kind, CheckedConnection::Kind::kGet);
  EXPECT_EQ(c.issued[1].local, buffer + 1);
  EXPECT_EQ(c.issued[1].remote_address, 4096u + 7);

  c.refuse_issue = true;
  EXPECT_TRUE(absl::IsFailedPrecondition(
      c.Put(buffer, 1, good, 0).Wait(absl::Now())));
}

TEST(CheckedConnectionTest, FlushWaitsForItsMarkerAndAbortsOnlyItAtTheDeadline) {
  RecordingConnection c;
  EXPECT_TRUE(absl::IsFailedPrecondition(c.Flush(absl::InfiniteFuture())));

  c.marker = std::make_shared<CompletionState>();
  std::thread finisher([marker = c.marker] {
    absl::SleepFor(absl::Milliseconds(20));
    marker->Finish(absl::OkStatus());
  });
  EXPECT_EQ(c.Flush(absl::Now() + absl::Seconds(10)), absl::OkStatus());
  finisher.join();

  c.marker = std::make_shared<CompletionState>();
  EXPECT_TRUE(absl::IsDeadlineExceeded(
      c.Flush(absl::Now() + absl::Milliseconds(10))));
  EXPECT_TRUE(c.marker->abort_requested());
  // The marker's own status, not the Abort's, once it finishes.
  c.marker->Finish(absl::UnavailableError("peer gone"));
  EXPECT_TRUE(absl::IsUnavailable(c.Flush(absl::Now())));
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
  bool enforces_remote_keys() const override { return true; }
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

TEST(BackendOptionsTest, SetCommonFillsEveryBackend) {
  TransportOptions common;
  common.name = "n";
  common.max_piece_bytes = 123;
  common.require_enforced_remote_keys = true;
  BackendOptions options;
  options.ucx.tls = "tcp";
  options.SetCommon(common);
  for (const TransportOptions* o :
       {&options.inproc.common, &options.ucx.common, &options.grpc.common}) {
    EXPECT_EQ(o->name, "n");
    EXPECT_EQ(o->max_piece_bytes, 123u);
    EXPECT_TRUE(o->require_enforced_remote_keys);
  }
  EXPECT_EQ(options.ucx.tls, "tcp");  // backends' own knobs untouched
}

TEST(RegistryTest, CreatesByNameAndRejectsUnknownOrDuplicate) {
  ASSERT_TRUE(RegisterTransportFactory(
                  "fake",
                  [](const BackendOptions& options)
                      -> absl::StatusOr<std::unique_ptr<Transport>> {
                    if (options.ucx.progress_threads < 1) {
                      return absl::InvalidArgumentError("progress_threads");
                    }
                    return std::make_unique<FakeTransport>(options.ucx.tls);
                  })
                  .ok());
  EXPECT_TRUE(absl::IsAlreadyExists(RegisterTransportFactory("fake", nullptr)));

  BackendOptions options;
  options.ucx.tls = "passed through";
  auto transport = CreateTransport("fake", options);
  ASSERT_TRUE(transport.ok()) << transport.status();
  EXPECT_EQ((*transport)->kind(), "fake");
  EXPECT_EQ((*transport)->LocalAddress(), "passed through");

  const absl::Status missing = CreateTransport("nope").status();
  EXPECT_TRUE(absl::IsNotFound(missing));
  EXPECT_NE(missing.message().find("fake"),
            absl::string_view::npos);  // lists names

  // The factory's own errors come back as they are.
  options.ucx.progress_threads = 0;
  EXPECT_TRUE(
      absl::IsInvalidArgument(CreateTransport("fake", options).status()));

  const std::vector<std::string> names = RegisteredTransports();
  EXPECT_NE(std::find(names.begin(), names.end(), "fake"), names.end());
}

}  // namespace
}  // namespace zeroshard::transport
