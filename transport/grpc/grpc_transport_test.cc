// What the conformance suite does not cover for the "grpc" transport:
// addresses and the listen_address option, access checks, keys, revocation,
// aborting queued operations and the Transport's shutdown.

#include "transport/grpc/grpc_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/host_address.h"
#include "transport/transport.h"

namespace zeroshard::transport::grpc {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr size_t kRegionBytes = size_t{1} << 20;

absl::Time Deadline() { return absl::Now() + absl::Seconds(10); }

bool AllBytesAre(const void* p, size_t length, unsigned char value) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < length; ++i) {
    if (b[i] != value) return false;
  }
  return true;
}

// The port of a "HOST:PORT" address, or -1.
int PortOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port)) {
    return -1;
  }
  return port;
}

std::unique_ptr<Transport> NewTransport(const std::string& name,
                                        const std::string& listen = "") {
  BackendOptions options;
  options.grpc.common.name = name;
  options.grpc.listen_address = listen;
  auto transport = CreateTransport("grpc", options);
  EXPECT_TRUE(transport.ok()) << transport.status();
  return transport.ok() ? *std::move(transport) : nullptr;
}

class GrpcTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = NewTransport("server");
    client_ = NewTransport("client");
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(client_, nullptr);
    auto connection = client_->Connect(server_->LocalAddress(), Deadline());
    ASSERT_TRUE(connection.ok()) << connection.status();
    connection_ = *std::move(connection);
  }

  // A region of kRegionBytes over memory_ (filled with `fill`).
  std::unique_ptr<Region> Register(Access access, unsigned char fill = 0) {
    memory_.assign(kRegionBytes, fill);
    auto region = server_->RegisterRegion(memory_.data(), memory_.size(),
                                          access);
    EXPECT_TRUE(region.ok()) << region.status();
    return region.ok() ? *std::move(region) : nullptr;
  }

  absl::Status PutWait(const void* src, size_t length,
                       const RegionDescriptor& dst, uint64_t offset) {
    return connection_->Put(src, length, dst, offset).Wait(Deadline());
  }
  absl::Status GetWait(void* dst, size_t length, const RegionDescriptor& src,
                       uint64_t offset) {
    return connection_->Get(dst, length, src, offset).Wait(Deadline());
  }

  std::vector<unsigned char> memory_;
  std::unique_ptr<Transport> server_;
  std::unique_ptr<Transport> client_;
  std::unique_ptr<Connection> connection_;
};

TEST(GrpcTransportOptionsTest, RegisteredAsGrpc) {
  EXPECT_THAT(RegisteredTransports(), Contains("grpc"));
  std::unique_ptr<Transport> transport = NewTransport("t");
  ASSERT_NE(transport, nullptr);
  EXPECT_EQ(transport->kind(), "grpc");
  // Its server checks every key (region id and token), range and Access.
  EXPECT_TRUE(transport->enforces_remote_keys());
}

TEST(GrpcTransportOptionsTest, LocalAddressHasTheBoundPort) {
  std::unique_ptr<Transport> a = NewTransport("a");
  std::unique_ptr<Transport> b = NewTransport("b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  // The default listens on loopback, any port.
  EXPECT_THAT(a->LocalAddress(), StartsWith("127.0.0.1:"));
  const int port = PortOf(a->LocalAddress());
  EXPECT_GT(port, 0);
  EXPECT_LE(port, 65535);
  EXPECT_NE(PortOf(b->LocalAddress()), port);
}

TEST(GrpcTransportOptionsTest, ListenAddressOption) {
  std::unique_ptr<Transport> explicit_loopback =
      NewTransport("loopback", "127.0.0.1:0");
  ASSERT_NE(explicit_loopback, nullptr);
  EXPECT_THAT(explicit_loopback->LocalAddress(), StartsWith("127.0.0.1:"));
  EXPECT_GT(PortOf(explicit_loopback->LocalAddress()), 0);

  std::unique_ptr<Transport> by_name = NewTransport("named", "localhost:0");
  ASSERT_NE(by_name, nullptr);
  EXPECT_THAT(by_name->LocalAddress(), StartsWith("localhost:"));
  EXPECT_GT(PortOf(by_name->LocalAddress()), 0);
  // Its address works for Connect.
  auto connection = explicit_loopback->Connect(by_name->LocalAddress(),
                                               Deadline());
  ASSERT_TRUE(connection.ok()) << connection.status();
  EXPECT_EQ((*connection)->peer_name(), "named");

  // A port that is taken is refused, not shared.
  GrpcTransportOptions options;
  options.listen_address = explicit_loopback->LocalAddress();
  auto taken = CreateGrpcTransport(options);
  EXPECT_TRUE(absl::IsUnavailable(taken.status())) << taken.status();

  for (const char* bad : {"nonsense", "127.0.0.1", "127.0.0.1:", ":0",
                          "127.0.0.1:65536", "127.0.0.1:x", "bad host:0",
                          "[::1:0"}) {
    SCOPED_TRACE(bad);
    options.listen_address = bad;
    EXPECT_TRUE(absl::IsInvalidArgument(CreateGrpcTransport(options).status()));
  }
}

// This machine's first non-loopback IPv4 address (getifaddrs), or empty.
std::string NonLoopbackIpv4() {
  const std::vector<InterfaceAddress> addresses = NonLoopbackIpv4Addresses();
  return addresses.empty() ? "" : addresses.front().address;
}

// Puts bytes into a region of `server` through a Connection that `client`
// makes to `server`'s LocalAddress(), and Gets them back.
void ExpectRoundTrip(Transport& server, Transport& client) {
  std::vector<unsigned char> memory(4096, 0);
  auto region = server.RegisterRegion(memory.data(), memory.size(),
                                      Access::kRemoteReadWrite);
  ASSERT_TRUE(region.ok()) << region.status();
  auto connection = client.Connect(server.LocalAddress(), Deadline());
  ASSERT_TRUE(connection.ok()) << connection.status();
  std::vector<unsigned char> data(memory.size()), back(memory.size());
  for (size_t i = 0; i < data.size(); ++i) data[i] = i * 13 + 5;
  ASSERT_EQ((*connection)
                ->Put(data.data(), data.size(), (*region)->Descriptor(), 0)
                .Wait(Deadline()),
            absl::OkStatus());
  EXPECT_EQ(memory, data);
  ASSERT_EQ((*connection)
                ->Get(back.data(), back.size(), (*region)->Descriptor(), 0)
                .Wait(Deadline()),
            absl::OkStatus());
  EXPECT_EQ(back, data);
}

TEST(GrpcTransportAddressTest, NonLoopbackListenHostIsAdvertisedAndServes) {
  const std::string ip = NonLoopbackIpv4();
  if (ip.empty()) GTEST_SKIP() << "no non-loopback IPv4 address on this machine";
  std::unique_ptr<Transport> server = NewTransport("server", ip + ":0");
  std::unique_ptr<Transport> client = NewTransport("client");
  ASSERT_NE(server, nullptr);
  ASSERT_NE(client, nullptr);
  EXPECT_THAT(server->LocalAddress(), StartsWith(ip + ":"));
  EXPECT_GT(PortOf(server->LocalAddress()), 0);
  ExpectRoundTrip(*server, *client);
}

TEST(GrpcTransportAddressTest, WildcardListenAdvertisesThePrimaryAddress) {
  if (NonLoopbackIpv4().empty()) {
    GTEST_SKIP() << "no non-loopback IPv4 address on this machine";
  }
  std::unique_ptr<Transport> server = NewTransport("server", "0.0.0.0:0");
  std::unique_ptr<Transport> client = NewTransport("client");
  ASSERT_NE(server, nullptr);
  ASSERT_NE(client, nullptr);
  // Not the wildcard, not a name that may resolve to loopback on this
  // machine or to nothing on another one: the primary address itself.
  const absl::StatusOr<std::string> primary = PrimaryHostAddress();
  ASSERT_TRUE(primary.ok()) << primary.status();
  EXPECT_EQ(server->LocalAddress(),
            absl::StrCat(*primary, ":", PortOf(server->LocalAddress())));
  EXPECT_THAT(server->LocalAddress(), ::testing::Not(StartsWith("127.")));
  ExpectRoundTrip(*server, *client);
}

TEST(GrpcTransportAddressTest, AdvertiseHostIsWhatPeersAreGiven) {
  const std::string ip = NonLoopbackIpv4();
  if (ip.empty()) GTEST_SKIP() << "no non-loopback IPv4 address on this machine";
  // Listening everywhere, advertising one address: peers dial that.
  BackendOptions options;
  options.grpc.common.name = "server";
  options.grpc.listen_address = "0.0.0.0:0";
  options.grpc.advertise_host = ip;
  auto server = CreateTransport("grpc", options);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_THAT((*server)->LocalAddress(), StartsWith(ip + ":"));
  std::unique_ptr<Transport> client = NewTransport("client");
  ASSERT_NE(client, nullptr);
  ExpectRoundTrip(**server, *client);
}

TEST(GrpcTransportAddressTest, AdvertiseHostReplacesTheListenHost) {
  GrpcTransportOptions options;
  options.listen_address = "127.0.0.1:0";
  options.advertise_host = "zs-advertised.example";
  auto named = CreateGrpcTransport(options);
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ((*named)->LocalAddress(),
            absl::StrCat("zs-advertised.example:",
                         PortOf((*named)->LocalAddress())));
  EXPECT_GT(PortOf((*named)->LocalAddress()), 0);

  // An IPv6 address as Kubernetes' status.podIP gives it, unbracketed.
  options.advertise_host = "fd00::12";
  auto v6 = CreateGrpcTransport(options);
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_THAT((*v6)->LocalAddress(), StartsWith("[fd00::12]:"));

  for (const char* bad : {"10.0.0.1:7070", "0.0.0.0", "bad host"}) {
    SCOPED_TRACE(bad);
    options.advertise_host = bad;
    const absl::Status status = CreateGrpcTransport(options).status();
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("advertise_host"));
  }
}

TEST_F(GrpcTransportTest, ConnectToMalformedAddressIsInvalidArgument) {
  for (const char* bad :
       {"", "127.0.0.1", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:70000",
        "127.0.0.1:+80", "[::1:80", "bad host:80", "host\n:80"}) {
    SCOPED_TRACE(bad);
    EXPECT_TRUE(
        absl::IsInvalidArgument(client_->Connect(bad, Deadline()).status()));
  }
}

TEST_F(GrpcTransportTest, ConnectToNobodyFailsByTheDeadline) {
  // A port nobody listens on: bound (so nobody else can take it) but not
  // listening, so connections to it are refused.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const std::string address = absl::StrCat("127.0.0.1:", ntohs(a.sin_port));
  const absl::Time start = absl::Now();
  auto connection = client_->Connect(address, absl::Now() + absl::Seconds(1));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_TRUE(absl::IsUnavailable(connection.status()) ||
              absl::IsDeadlineExceeded(connection.status()))
      << connection.status();
  close(fd);
}

TEST_F(GrpcTransportTest, PeerNameAndRoundTrip) {
  EXPECT_EQ(connection_->peer_name(), "server");
  std::unique_ptr<Region> region = Register(Access::kRemoteReadWrite);
  ASSERT_NE(region, nullptr);
  std::vector<unsigned char> data(3 * kRegionBytes / 4), back(data.size());
  for (size_t i = 0; i < data.size(); ++i) data[i] = i * 7 + 1;
  ASSERT_EQ(PutWait(data.data(), data.size(), region->Descriptor(), 5),
            absl::OkStatus());
  EXPECT_EQ(std::memcmp(memory_.data() + 5, data.data(), data.size()), 0);
  ASSERT_EQ(GetWait(back.data(), back.size(), region->Descriptor(), 5),
            absl::OkStatus());
  EXPECT_EQ(back, data);
}

TEST_F(GrpcTransportTest, DestroyedRegionIsRevoked) {
  std::unique_ptr<Region> region = Register(Access::kRemoteReadWrite, 0x33);
  ASSERT_NE(region, nullptr);
  const RegionDescriptor stale = region->Descriptor();
  region.reset();
  std::vector<unsigned char> buffer(kRegionBytes, 0x44);
  const absl::Status put = PutWait(buffer.data(), buffer.size(), stale, 0);
  EXPECT_TRUE(absl::IsUnavailable(put)) << put;
  EXPECT_THAT(std::string(put.message()), HasSubstr("no longer exists"));
  EXPECT_THAT(std::string(put.message()), HasSubstr("server"));
  EXPECT_TRUE(AllBytesAre(memory_.data(), memory_.size(), 0x33));
  const absl::Status get = GetWait(buffer.data(), 4096, stale, 0);
  EXPECT_TRUE(absl::IsUnavailable(get)) << get;
  EXPECT_TRUE(AllBytesAre(buffer.data(), buffer.size(), 0x44));
}

TEST_F(GrpcTransportTest, AccessIsEnforcedPerDirection) {
  std::vector<unsigned char> src(4096, 0x77), dst(4096, 0x88);
  {
    std::unique_ptr<Region> read_only = Register(Access::kRemoteRead, 0x11);
    ASSERT_NE(read_only, nullptr);
    const absl::Status put =
        PutWait(src.data(), src.size(), read_only->Descriptor(), 0);
    EXPECT_TRUE(absl::IsPermissionDenied(put)) << put;
    EXPECT_THAT(std::string(put.message()), HasSubstr("writes"));
    EXPECT_TRUE(AllBytesAre(memory_.data(), memory_.size(), 0x11));
    EXPECT_EQ(GetWait(dst.data(), dst.size(), read_only->Descriptor(), 0),
              absl::OkStatus());
    EXPECT_TRUE(AllBytesAre(dst.data(), dst.size(), 0x11));
  }
  {
    std::unique_ptr<Region> write_only = Register(Access::kRemoteWrite, 0x22);
    ASSERT_NE(write_only, nullptr);
    std::fill(dst.begin(), dst.end(), 0x88);
    const absl::Status get =
        GetWait(dst.data(), dst.size(), write_only->Descriptor(), 0);
    EXPECT_TRUE(absl::IsPermissionDenied(get)) << get;
    EXPECT_THAT(std::string(get.message()), HasSubstr("reads"));
    EXPECT_TRUE(AllBytesAre(dst.data(), dst.size(), 0x88));
    EXPECT_EQ(PutWait(src.data(), src.size(), write_only->Descriptor(), 0),
              absl::OkStatus());
    EXPECT_TRUE(AllBytesAre(memory_.data(), src.size(), 0x77));
  }
}

TEST_F(GrpcTransportTest, WrongTokenIsUnavailable) {
  std::unique_ptr<Region> region = Register(Access::kRemoteReadWrite);
  ASSERT_NE(region, nullptr);
  std::vector<unsigned char> buffer(4096, 0x55);
  RegionDescriptor forged = region->Descriptor();
  forged.rkey.back() ^= 0x01;  // the token's last byte
  const absl::Status put = PutWait(buffer.data(), buffer.size(), forged, 0);
  EXPECT_TRUE(absl::IsUnavailable(put)) << put;
  EXPECT_TRUE(
      absl::IsUnavailable(GetWait(buffer.data(), buffer.size(), forged, 0)));

  // A descriptor of another Transport's region (same id, other token).
  std::unique_ptr<Transport> other = NewTransport("other");
  ASSERT_NE(other, nullptr);
  std::vector<unsigned char> other_memory(kRegionBytes);
  auto other_region = other->RegisterRegion(
      other_memory.data(), other_memory.size(), Access::kRemoteReadWrite);
  ASSERT_TRUE(other_region.ok()) << other_region.status();
  const absl::Status misdirected =
      PutWait(buffer.data(), buffer.size(), (*other_region)->Descriptor(), 0);
  EXPECT_TRUE(absl::IsUnavailable(misdirected)) << misdirected;
  EXPECT_TRUE(AllBytesAre(memory_.data(), memory_.size(), 0));
  EXPECT_TRUE(AllBytesAre(other_memory.data(), other_memory.size(), 0));
}

TEST_F(GrpcTransportTest, ServerChecksAddressAndLength) {
  std::unique_ptr<Region> region = Register(Access::kRemoteReadWrite, 0x66);
  ASSERT_NE(region, nullptr);
  std::vector<unsigned char> buffer(8192, 0x99);
  // Passes the local checks against the (forged) descriptor, not the
  // server's against the region.
  RegionDescriptor moved = region->Descriptor();
  moved.address += 64;
  EXPECT_TRUE(absl::IsInvalidArgument(PutWait(buffer.data(), 16, moved, 0)));
  RegionDescriptor longer = region->Descriptor();
  longer.length += 8192;
  const absl::Status put =
      PutWait(buffer.data(), buffer.size(), longer, kRegionBytes - 4096);
  EXPECT_TRUE(absl::IsInvalidArgument(put)) << put;
  EXPECT_THAT(std::string(put.message()), HasSubstr("outside"));
  EXPECT_TRUE(AllBytesAre(memory_.data(), memory_.size(), 0x66));
}

TEST_F(GrpcTransportTest, AllocatedRegionsAreAlignedAndZeroed) {
  for (size_t length : {size_t{1}, size_t{63}, size_t{64}, size_t{4097}}) {
    SCOPED_TRACE(length);
    auto region = server_->AllocateRegion(length, Access::kRemoteReadWrite);
    ASSERT_TRUE(region.ok()) << region.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>((*region)->base()) % 64, 0u);
    EXPECT_EQ((*region)->length(), length);
    EXPECT_TRUE(AllBytesAre((*region)->base(), length, 0));
  }
  EXPECT_TRUE(absl::IsInvalidArgument(
      server_->RegisterRegion(nullptr, 10, Access::kRemoteRead).status()));
}

TEST_F(GrpcTransportTest, AbortedQueuedOperationsAreNeverSent) {
  constexpr size_t kBig = size_t{64} << 20;
  std::vector<unsigned char> remote(kBig, 0);
  auto region = server_->RegisterRegion(remote.data(), remote.size(),
                                        Access::kRemoteReadWrite);
  ASSERT_TRUE(region.ok()) << region.status();
  std::vector<unsigned char> big(kBig, 1);
  std::vector<unsigned char> small(4096, 2);
  Completion first =
      connection_->Put(big.data(), big.size(), (*region)->Descriptor(), 0);
  // Queued behind the big Put, then aborted.
  Completion second =
      connection_->Put(small.data(), small.size(), (*region)->Descriptor(), 0);
  second.Abort();
  const absl::Status aborted = second.Wait(Deadline());
  EXPECT_TRUE(aborted.ok() || absl::IsCancelled(aborted)) << aborted;
  ASSERT_EQ(first.Wait(Deadline()), absl::OkStatus());
  ASSERT_EQ(connection_->Flush(Deadline()), absl::OkStatus());
  if (absl::IsCancelled(aborted)) {
    EXPECT_TRUE(AllBytesAre(remote.data(), small.size(), 1));
  }
  // The connection still works.
  EXPECT_EQ(PutWait(small.data(), small.size(), (*region)->Descriptor(), 0),
            absl::OkStatus());
  EXPECT_TRUE(AllBytesAre(remote.data(), small.size(), 2));
}

TEST_F(GrpcTransportTest, ClosedByTransportShutdown) {
  std::unique_ptr<Region> region = Register(Access::kRemoteReadWrite);
  ASSERT_NE(region, nullptr);
  client_.reset();
  std::vector<unsigned char> buffer(16, 1);
  const absl::Status put =
      PutWait(buffer.data(), buffer.size(), region->Descriptor(), 0);
  EXPECT_TRUE(absl::IsFailedPrecondition(put)) << put;
  EXPECT_TRUE(absl::IsFailedPrecondition(connection_->Flush(Deadline())));
  EXPECT_TRUE(AllBytesAre(memory_.data(), memory_.size(), 0));
}

TEST_F(GrpcTransportTest, FlushReportsAPeerThatIsGone) {
  EXPECT_EQ(connection_->Flush(Deadline()), absl::OkStatus());
  auto allocated = server_->AllocateRegion(4096, Access::kRemoteReadWrite);
  ASSERT_TRUE(allocated.ok()) << allocated.status();
  server_.reset();  // the allocated region outlives its Transport
  const absl::Status flush = connection_->Flush(Deadline());
  EXPECT_TRUE(absl::IsUnavailable(flush)) << flush;
  EXPECT_THAT(std::string(flush.message()), HasSubstr("server"));
  allocated->reset();
}

}  // namespace
}  // namespace zeroshard::transport::grpc
