// Behaviour specific to the inproc transport; the shared behaviour is in
// transport_conformance_test.cc.
#include "transport/inproc/inproc_transport.h"

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "transport/transport.h"

namespace zeroshard::transport::inproc {
namespace {

absl::Time Deadline() { return absl::Now() + absl::Seconds(10); }

TEST(InprocTransportTest, RegisteredThroughTheRegistry) {
  auto transport = CreateTransport("inproc");
  ASSERT_TRUE(transport.ok()) << transport.status();
  EXPECT_EQ((*transport)->kind(), "inproc");
}

TEST(InprocTransportTest, AccessFlagsAreEnforced) {
  auto server = CreateInprocTransport({});
  auto client = CreateInprocTransport({});
  ASSERT_TRUE(server.ok() && client.ok());
  std::vector<char> read_only(64, 'r'), write_only(64, 'w');
  auto readable =
      (*server)->RegisterRegion(read_only.data(), 64, Access::kRemoteRead);
  auto writable =
      (*server)->RegisterRegion(write_only.data(), 64, Access::kRemoteWrite);
  ASSERT_TRUE(readable.ok() && writable.ok());
  auto connection = (*client)->Connect((*server)->LocalAddress(), Deadline());
  ASSERT_TRUE(connection.ok()) << connection.status();

  char buffer[64] = {0};
  EXPECT_TRUE(absl::IsPermissionDenied(
      (*connection)
          ->Put(buffer, 8, (*readable)->Descriptor(), 0)
          .Wait(Deadline())));
  EXPECT_EQ(read_only[0], 'r');
  EXPECT_TRUE(absl::IsPermissionDenied(
      (*connection)
          ->Get(buffer, 8, (*writable)->Descriptor(), 0)
          .Wait(Deadline())));
  EXPECT_EQ(buffer[0], 0);
  EXPECT_TRUE((*connection)
                  ->Get(buffer, 8, (*readable)->Descriptor(), 0)
                  .Wait(Deadline())
                  .ok());
  EXPECT_EQ(buffer[0], 'r');
}

TEST(InprocTransportTest, ForgedOrForeignDescriptorsAreRefused) {
  auto server = CreateInprocTransport({});
  auto other = CreateInprocTransport({});
  auto client = CreateInprocTransport({});
  ASSERT_TRUE(server.ok() && other.ok() && client.ok());
  std::vector<char> memory(128), elsewhere(128);
  auto region =
      (*server)->RegisterRegion(memory.data(), 128, Access::kRemoteReadWrite);
  auto foreign =
      (*other)->RegisterRegion(elsewhere.data(), 128, Access::kRemoteReadWrite);
  ASSERT_TRUE(region.ok() && foreign.ok());
  auto connection = (*client)->Connect((*server)->LocalAddress(), Deadline());
  ASSERT_TRUE(connection.ok());
  char byte = 1;

  // A descriptor of another transport, sent to this peer.
  EXPECT_TRUE(
      absl::IsInvalidArgument((*connection)
                                  ->Put(&byte, 1, (*foreign)->Descriptor(), 0)
                                  .Wait(Deadline())));
  // The right key with a widened length or a moved address.
  RegionDescriptor forged = (*region)->Descriptor();
  forged.length = 1 << 20;
  EXPECT_TRUE(absl::IsInvalidArgument(
      (*connection)->Put(&byte, 1, forged, 4096).Wait(Deadline())));
  forged = (*region)->Descriptor();
  forged.address = reinterpret_cast<uintptr_t>(elsewhere.data());
  EXPECT_TRUE(absl::IsInvalidArgument(
      (*connection)->Put(&byte, 1, forged, 0).Wait(Deadline())));
  EXPECT_EQ(elsewhere[0], 0);
}

TEST(InprocTransportTest, RegionDestroyedWhileCopiesRunIsSafe) {
  auto server = CreateInprocTransport({});
  auto client = CreateInprocTransport({});
  ASSERT_TRUE(server.ok() && client.ok());
  auto connection = (*client)->Connect((*server)->LocalAddress(), Deadline());
  ASSERT_TRUE(connection.ok());
  std::vector<char> src(1 << 20, 'x');
  for (int round = 0; round < 20; ++round) {
    auto memory = std::make_unique<std::vector<char>>(1 << 20);
    auto region = (*server)->RegisterRegion(memory->data(), memory->size(),
                                            Access::kRemoteReadWrite);
    ASSERT_TRUE(region.ok());
    const RegionDescriptor descriptor = (*region)->Descriptor();
    std::vector<Completion> puts;
    for (int i = 0; i < 8; ++i) {
      puts.push_back((*connection)->Put(src.data(), src.size(), descriptor, 0));
    }
    region->reset();  // waits for a copy under way, then refuses the rest
    memory.reset();
    for (auto& put : puts) {
      const absl::Status status = put.Wait(Deadline());
      EXPECT_TRUE(status.ok() || absl::IsUnavailable(status)) << status;
    }
    EXPECT_TRUE(absl::IsUnavailable(
        (*connection)->Put(src.data(), 8, descriptor, 0).Wait(Deadline())));
  }
}

TEST(InprocTransportTest, SeveralExecutorsServeSeveralConnections) {
  InprocTransportOptions options;
  options.progress_threads = 3;
  auto server = CreateInprocTransport({});
  auto client = CreateInprocTransport(options);
  ASSERT_TRUE(server.ok() && client.ok());
  std::vector<char> memory(4096);
  auto region = (*server)->RegisterRegion(memory.data(), memory.size(),
                                          Access::kRemoteReadWrite);
  ASSERT_TRUE(region.ok());
  for (int i = 0; i < 6; ++i) {
    auto connection = (*client)->Connect((*server)->LocalAddress(), Deadline());
    ASSERT_TRUE(connection.ok());
    const char byte = static_cast<char>('a' + i);
    ASSERT_TRUE((*connection)
                    ->Put(&byte, 1, (*region)->Descriptor(), i)
                    .Wait(Deadline())
                    .ok());
    EXPECT_EQ((*connection)->Flush(Deadline()), absl::OkStatus());
  }
  EXPECT_EQ(std::string(memory.data(), 6), "abcdef");
}

TEST(InprocTransportTest, CopiesInPiecesOfMaxPieceBytes) {
  InprocTransportOptions options;
  options.common.max_piece_bytes = 1000;  // not a divisor of anything below
  auto server = CreateInprocTransport(options);
  auto client = CreateInprocTransport(options);
  ASSERT_TRUE(server.ok() && client.ok());
  EXPECT_TRUE((*server)->enforces_remote_keys());
  constexpr size_t kBytes = 100003;
  std::vector<char> memory(kBytes + 5, 0), data(kBytes), back(kBytes);
  for (size_t i = 0; i < kBytes; ++i) data[i] = static_cast<char>(i * 31 + 1);
  auto region = (*server)->RegisterRegion(memory.data(), memory.size(),
                                          Access::kRemoteReadWrite);
  ASSERT_TRUE(region.ok());
  auto connection = (*client)->Connect((*server)->LocalAddress(), Deadline());
  ASSERT_TRUE(connection.ok());
  ASSERT_EQ((*connection)
                ->Put(data.data(), kBytes, (*region)->Descriptor(), 5)
                .Wait(Deadline()),
            absl::OkStatus());
  EXPECT_EQ(std::memcmp(memory.data() + 5, data.data(), kBytes), 0);
  ASSERT_EQ((*connection)
                ->Get(back.data(), kBytes, (*region)->Descriptor(), 5)
                .Wait(Deadline()),
            absl::OkStatus());
  EXPECT_TRUE(back == data);

  options.common.max_piece_bytes = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(CreateInprocTransport(options).status()));
}

TEST(InprocTransportTest, AbortBeforeExecutionCancels) {
  auto server = CreateInprocTransport({});
  auto client = CreateInprocTransport({});
  ASSERT_TRUE(server.ok() && client.ok());
  std::vector<char> memory(64 << 20), src(64 << 20, 'z');
  auto region = (*server)->RegisterRegion(memory.data(), memory.size(),
                                          Access::kRemoteReadWrite);
  auto connection = (*client)->Connect((*server)->LocalAddress(), Deadline());
  ASSERT_TRUE(region.ok() && connection.ok());
  // The second put queues behind the first (one executor), so it is aborted
  // before it runs.
  Completion first =
      (*connection)->Put(src.data(), src.size(), (*region)->Descriptor(), 0);
  Completion second =
      (*connection)->Put(src.data(), 16, (*region)->Descriptor(), 0);
  second.Abort();
  const absl::Status status = second.Wait(Deadline());
  EXPECT_TRUE(absl::IsCancelled(status) || status.ok()) << status;
  EXPECT_EQ(first.Wait(Deadline()), absl::OkStatus());
}

}  // namespace
}  // namespace zeroshard::transport::inproc
