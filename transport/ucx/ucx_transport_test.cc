// Behaviour specific to the UCX transport; the shared behaviour is in
// transport_conformance_test.cc (over tcp and shared memory).
#include "transport/ucx/ucx_transport.h"

#include <fcntl.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "transport/transport.h"

namespace zeroshard::transport::ucx {
namespace {

absl::Time Deadline() { return absl::Now() + absl::Seconds(10); }

class UcxTransportTest : public ::testing::TestWithParam<std::string> {
 protected:
  // A transport over GetParam() as UCX_TLS, or null after GTEST_SKIP.
  std::unique_ptr<Transport> Make(UcxTransportOptions options = {}) {
    options.tls = GetParam();
    auto transport = CreateUcxTransport(options);
    if (!transport.ok()) {
      ADD_FAILURE_AT(__FILE__, __LINE__)
          << "unexpected: " << transport.status();
      return nullptr;
    }
    return *std::move(transport);
  }

  void SetUp() override {
    UcxTransportOptions options;
    options.tls = GetParam();
    auto probe = CreateUcxTransport(options);
    if (!probe.ok())
      GTEST_SKIP() << "UCX_TLS=" << GetParam() << ": " << probe.status();
  }
};

TEST_P(UcxTransportTest, RegisteredThroughTheRegistry) {
  BackendOptions options;
  options.ucx.tls = GetParam();
  auto transport = CreateTransport("ucx", options);
  ASSERT_TRUE(transport.ok()) << transport.status();
  EXPECT_EQ((*transport)->kind(), "ucx");
  EXPECT_FALSE((*transport)->LocalAddress().empty());
}

TEST_P(UcxTransportTest, DamagedAddressesAndRkeysAreRefusedBeforeUcxSeesThem) {
  auto server = Make();
  auto client = Make();
  ASSERT_TRUE(server && client);
  std::vector<char> memory(4096);
  auto region = server->RegisterRegion(memory.data(), memory.size(),
                                       Access::kRemoteReadWrite);
  ASSERT_TRUE(region.ok()) << region.status();

  std::string address = server->LocalAddress();
  address[address.size() / 3] ^= 0x10;
  EXPECT_TRUE(
      absl::IsInvalidArgument(client->Connect(address, Deadline()).status()));

  EXPECT_TRUE(absl::IsInvalidArgument(
      client->Connect("ZSIA........", Deadline()).status()));

  auto connection = client->Connect(server->LocalAddress(), Deadline());
  ASSERT_TRUE(connection.ok()) << connection.status();
  RegionDescriptor damaged = (*region)->Descriptor();
  damaged.rkey[10] ^= 0x01;
  char byte = 1;
  EXPECT_TRUE(absl::IsInvalidArgument(
      (*connection)->Put(&byte, 1, damaged, 0).Wait(Deadline())));
  damaged.rkey.resize(damaged.rkey.size() / 2);
  EXPECT_TRUE(absl::IsInvalidArgument(
      (*connection)->Put(&byte, 1, damaged, 0).Wait(Deadline())));
  EXPECT_EQ(memory[0], 0);
  // The connection is unharmed.
  EXPECT_EQ(
      (*connection)->Put(&byte, 1, (*region)->Descriptor(), 0).Wait(Deadline()),
      absl::OkStatus());
  EXPECT_EQ(memory[0], 1);
}

TEST_P(UcxTransportTest, ManySmallPiecesAndSeveralProgressThreads) {
  UcxTransportOptions options;
  options.progress_threads = 2;
  options.common.max_piece_bytes = 64 << 10;
  options.max_pieces_in_flight = 2;
  auto server = Make(options);
  auto client = Make(options);
  ASSERT_TRUE(server && client);
  constexpr size_t kBytes = (10 << 20) + 7;
  auto region = server->AllocateRegion(kBytes, Access::kRemoteReadWrite);
  ASSERT_TRUE(region.ok()) << region.status();
  std::vector<unsigned char> data(kBytes), back(kBytes);
  for (size_t i = 0; i < kBytes; ++i)
    data[i] = static_cast<unsigned char>(i * 7 + i / 4096);
  for (int c = 0; c < 3; ++c) {  // connections land on different workers
    auto connection = client->Connect(server->LocalAddress(), Deadline());
    ASSERT_TRUE(connection.ok()) << connection.status();
    std::fill(back.begin(), back.end(), 0);
    ASSERT_EQ((*connection)
                  ->Put(data.data(), kBytes, (*region)->Descriptor(), 0)
                  .Wait(Deadline()),
              absl::OkStatus());
    EXPECT_EQ(std::memcmp((*region)->base(), data.data(), kBytes), 0);
    ASSERT_EQ((*connection)
                  ->Get(back.data(), kBytes, (*region)->Descriptor(), 0)
                  .Wait(Deadline()),
              absl::OkStatus());
    EXPECT_TRUE(back == data);
  }
}

TEST_P(UcxTransportTest, UseAfterShutdownFailsCleanly) {
  auto server = Make();
  auto client = Make();
  ASSERT_TRUE(server && client);
  auto region = server->AllocateRegion(4096, Access::kRemoteReadWrite);
  ASSERT_TRUE(region.ok());
  auto connection = client->Connect(server->LocalAddress(), Deadline());
  ASSERT_TRUE(connection.ok());
  client.reset();
  char byte = 0;
  EXPECT_TRUE(
      absl::IsFailedPrecondition((*connection)
                                     ->Put(&byte, 1, (*region)->Descriptor(), 0)
                                     .Wait(Deadline())));
  EXPECT_TRUE(absl::IsFailedPrecondition((*connection)->Flush(Deadline())));
  server.reset();
  region->reset();  // after its Transport: still fine
}

// Descriptors this process has open.
int OpenDescriptors() {
  int n = 0;
  for (int fd = 0; fd < 65536; ++fd) n += fcntl(fd, F_GETFD) != -1;
  return n;
}

// A connection to a peer that went away (its Transport destroyed; a peer on
// this host has no UCX peer error handling, so its going is noticed through
// the transport registry or its process) holds no descriptor once dropped
// (UCX's socket to the peer), as for a connection dropped before its peer
// went. (UCX keeps such an endpoint itself until the worker ends: see
// Worker::Close.)
TEST_P(UcxTransportTest, AConnectionToAPeerThatWentAwayIsReleasedWhenDropped) {
  auto client = Make();
  ASSERT_TRUE(client);
  // A peer, a connection to it and a Put; then both dropped, the peer first
  // or the connection first. Leaves the open descriptors where they were
  // before, waiting up to 5 s for them to go.
  auto round = [&](bool peer_first) {
    const int before = OpenDescriptors();
    auto server = Make();
    ASSERT_TRUE(server);
    auto region = server->AllocateRegion(4096, Access::kRemoteReadWrite);
    ASSERT_TRUE(region.ok()) << region.status();
    const RegionDescriptor descriptor = (*region)->Descriptor();
    auto connection = client->Connect(server->LocalAddress(), Deadline());
    ASSERT_TRUE(connection.ok()) << connection.status();
    char byte = 1;
    ASSERT_EQ((*connection)->Put(&byte, 1, descriptor, 0).Wait(Deadline()), absl::OkStatus());
    if (peer_first) {
      region->reset();
      server.reset();
      const absl::Status s = (*connection)->Put(&byte, 1, descriptor, 0).Wait(Deadline());
      EXPECT_TRUE(absl::IsUnavailable(s)) << s;
    }
    connection->reset();
    region->reset();
    server.reset();
    const absl::Time until = absl::Now() + absl::Seconds(5);
    int after = OpenDescriptors();
    while (after != before && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(20));
      after = OpenDescriptors();
    }
    EXPECT_EQ(after, before) << (peer_first ? "the peer went first" : "the connection went first");
  };
  round(false);  // whatever UCX sets up once per worker is there from here
  round(false);
  round(true);
  round(true);
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxTransportTest,
                         ::testing::Values("tcp", "posix,cma,self"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param == "tcp" ? std::string("tcp")
                                                      : std::string("shm");
                         });

// Shared memory reaches only peers that could read this process anyway;
// tcp, which UCX serves in software, does not enforce keys.
TEST_P(UcxTransportTest, EnforcesRemoteKeysOnlyWithoutTcp) {
  auto transport = Make();
  ASSERT_NE(transport, nullptr);
  EXPECT_EQ(transport->enforces_remote_keys(), GetParam() != "tcp");
}

TEST_P(UcxTransportTest, RequiringEnforcedKeysRefusesTcpBeforeStarting) {
  UcxTransportOptions options;
  options.common.require_enforced_remote_keys = true;
  options.tls = GetParam();
  auto transport = CreateUcxTransport(options);
  if (GetParam() == "tcp") {
    ASSERT_TRUE(absl::IsFailedPrecondition(transport.status()))
        << transport.status();
    EXPECT_NE(transport.status().message().find("tcp"), absl::string_view::npos)
        << transport.status();
  } else {
    ASSERT_TRUE(transport.ok()) << transport.status();
    EXPECT_TRUE((*transport)->enforces_remote_keys());
  }
}

TEST(UcxTransportOptionsTest, UnknownTlsOrBadOptionsFailWithoutCrashing) {
  UcxTransportOptions options;
  options.tls = "no_such_transport";
  const absl::Status status = CreateUcxTransport(options).status();
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  options = {};
  options.common.max_piece_bytes = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(CreateUcxTransport(options).status()));
  options = {};
  options.progress_threads = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(CreateUcxTransport(options).status()));
  options = {};
  options.max_pieces_in_flight = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(CreateUcxTransport(options).status()));
}

}  // namespace
}  // namespace zeroshard::transport::ucx
