#include "transport/testing/faulty_transport.h"

#include <string>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "transport/inproc/inproc_transport.h"

namespace zeroshard::transport::testing {
namespace {

using Mode = FaultyTransport::Mode;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

struct Rig {
  Rig() {
    server = *inproc::CreateInprocTransport();
    region = *server->AllocateRegion(4096, Access::kRemoteReadWrite);
    faulty = std::make_unique<FaultyTransport>(*inproc::CreateInprocTransport());
  }
  std::unique_ptr<Connection> Connect() {
    return *faulty->Connect(server->LocalAddress(), In(absl::Seconds(5)));
  }
  std::unique_ptr<Transport> server;
  std::unique_ptr<Region> region;
  std::unique_ptr<FaultyTransport> faulty;
};

TEST(FaultyTransportTest, AnOpenConnectionMovesBytesAndCountsOperations) {
  Rig rig;
  std::unique_ptr<Connection> c0 = rig.Connect(), c1 = rig.Connect();
  EXPECT_EQ(rig.faulty->connections_made(), 2);
  EXPECT_EQ(rig.faulty->kind(), "inproc");
  const std::string out = "sixteen bytes...";
  std::string in(out.size(), '\0');
  ASSERT_TRUE(c1->Put(out.data(), out.size(), rig.region->Descriptor(), 8)
                  .Wait(In(absl::Seconds(5)))
                  .ok());
  ASSERT_TRUE(c1->Get(in.data(), in.size(), rig.region->Descriptor(), 8)
                  .Wait(In(absl::Seconds(5)))
                  .ok());
  EXPECT_EQ(in, out);
  // Length 0 is not counted.
  EXPECT_TRUE(c1->Put(out.data(), 0, rig.region->Descriptor(), 0).Wait(In(absl::Seconds(5))).ok());
  EXPECT_EQ(rig.faulty->operations(0), 0);
  EXPECT_EQ(rig.faulty->operations(1), 2);
  EXPECT_TRUE(c0->Flush(In(absl::Seconds(5))).ok());
}

TEST(FaultyTransportTest, AClosedConnectionFailsCancelledWithoutMovingBytes) {
  Rig rig;
  rig.faulty->SetMode(1, Mode::kClosed);  // before it is made
  std::unique_ptr<Connection> c0 = rig.Connect(), c1 = rig.Connect();
  const std::string out = "sixteen bytes...";
  absl::Status s =
      c1->Put(out.data(), out.size(), rig.region->Descriptor(), 0).Wait(In(absl::Seconds(5)));
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
  EXPECT_EQ(std::string(static_cast<const char*>(rig.region->base()), out.size()),
            std::string(out.size(), '\0'));
  EXPECT_TRUE(absl::IsCancelled(c1->Flush(In(absl::Seconds(5)))));
  // The other connection is untouched; reopened, the closed one works.
  EXPECT_TRUE(c0->Put(out.data(), out.size(), rig.region->Descriptor(), 0)
                  .Wait(In(absl::Seconds(5)))
                  .ok());
  rig.faulty->SetMode(1, Mode::kOpen);
  EXPECT_TRUE(c1->Put(out.data(), out.size(), rig.region->Descriptor(), 0)
                  .Wait(In(absl::Seconds(5)))
                  .ok());
  EXPECT_EQ(rig.faulty->operations(1), 2);
}

TEST(FaultyTransportTest, AbortingAStalledOperationClosesItsConnection) {
  Rig rig;
  std::unique_ptr<Connection> c0 = rig.Connect(), c1 = rig.Connect();
  rig.faulty->SetMode(0, Mode::kStalled);
  rig.faulty->SetMode(1, Mode::kStalled);
  char bytes[64] = {};
  Completion a = c0->Get(bytes, 16, rig.region->Descriptor(), 0);
  Completion b = c0->Get(bytes + 16, 16, rig.region->Descriptor(), 16);
  Completion other = c1->Get(bytes + 32, 16, rig.region->Descriptor(), 32);
  EXPECT_TRUE(absl::IsDeadlineExceeded(a.Wait(In(absl::Milliseconds(20)))));
  EXPECT_FALSE(b.IsDone());
  a.Abort();
  // Both operations on connection 0 end Cancelled; connection 1's stays.
  EXPECT_TRUE(absl::IsCancelled(a.Wait(In(absl::Seconds(5)))));
  EXPECT_TRUE(absl::IsCancelled(b.Wait(In(absl::Seconds(5)))));
  EXPECT_FALSE(other.IsDone());
  // Connection 0 is closed from then on.
  absl::Status s = c0->Get(bytes, 16, rig.region->Descriptor(), 0).Wait(In(absl::Seconds(5)));
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
  EXPECT_TRUE(absl::IsDeadlineExceeded(c1->Flush(In(absl::Milliseconds(10)))));
  // Dropping a stalled operation's handle aborts it, and does not block.
  const absl::Time dropped = absl::Now();
  other = Completion();
  EXPECT_LT(absl::Now() - dropped, absl::Seconds(1));
  EXPECT_EQ(rig.faulty->operations(0), 3);
  EXPECT_EQ(rig.faulty->operations(1), 1);
}

}  // namespace
}  // namespace zeroshard::transport::testing
