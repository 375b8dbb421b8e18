// One suite, run against every transport: inproc, UCX over tcp, UCX over
// shared memory, gRPC. Both sides of a UCX or gRPC case are two Transports in
// this process, except the peer-death case, which kills a real peer process.

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/transport.h"

extern char** environ;

namespace zeroshard::transport {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kDeadline = absl::Seconds(10);
constexpr size_t kRegionBytes = size_t{1} << 20;
constexpr size_t kLargeBytes = size_t{64} << 20;

struct TransportCase {
  std::string label;
  std::string transport;
  std::string ucx_tls;
  // The peer-death test kills a separate process serving the region.
  bool peer_in_other_process = false;
  // Destroying the serving Transport inside this process is reported as
  // Unavailable.
  bool sees_local_peer_destroyed = false;
  // A Region destroyed by its owner is refused to peers (software-emulated
  // RMA cannot tell).
  bool refuses_revoked_region = false;
  // Transport::enforces_remote_keys().
  bool enforces_remote_keys = false;
};

std::string CaseName(const ::testing::TestParamInfo<TransportCase>& info) {
  return info.param.label;
}

// Deterministic, fast filler; different seeds give different bytes.
void Fill(void* dst, size_t length, uint64_t seed) {
  auto* p = static_cast<unsigned char*>(dst);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  size_t i = 0;
  for (; i + 8 <= length; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
  for (; i < length; ++i) p[i] = static_cast<unsigned char>(x >> (8 * (i % 8)));
}

bool AllBytesAre(const void* p, size_t length, unsigned char value) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < length; ++i) {
    if (b[i] != value) return false;
  }
  return true;
}

unsigned char PeerPattern(size_t i) {
  return static_cast<unsigned char>(i * 131 + 7);
}

absl::Time Deadline() { return absl::Now() + kDeadline; }

class TransportConformanceTest
    : public ::testing::TestWithParam<TransportCase> {
 protected:
  BackendOptions Options(const std::string& name) const {
    TransportOptions common;
    common.name = name;
    // Small pieces so that large transfers exercise splitting and windows.
    common.max_piece_bytes = size_t{1} << 20;
    BackendOptions options;
    options.SetCommon(common);
    options.ucx.tls = GetParam().ucx_tls;
    options.ucx.max_pieces_in_flight = 4;
    return options;
  }

  absl::StatusOr<std::unique_ptr<Transport>> NewTransport(
      const std::string& name) {
    return CreateTransport(GetParam().transport, Options(name));
  }

  void SetUp() override {
    auto server = NewTransport("server");
    if (!server.ok() && GetParam().transport != "inproc") {
      GTEST_SKIP() << GetParam().label
                   << " cannot initialise here: " << server.status();
    }
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    auto client = NewTransport("client");
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);

    server_memory_.assign(kRegionBytes, 0);
    auto region = server_->RegisterRegion(
        server_memory_.data(), server_memory_.size(), Access::kRemoteReadWrite);
    ASSERT_TRUE(region.ok()) << region.status();
    region_ = *std::move(region);
    slot_ = region_->Descriptor();

    auto connection = client_->Connect(server_->LocalAddress(), Deadline());
    ASSERT_TRUE(connection.ok()) << connection.status();
    connection_ = *std::move(connection);
  }

  absl::Status PutWait(const void* src, size_t length,
                       const RegionDescriptor& dst, uint64_t offset) {
    return connection_->Put(src, length, dst, offset).Wait(Deadline());
  }
  absl::Status GetWait(void* dst, size_t length, const RegionDescriptor& src,
                       uint64_t offset) {
    return connection_->Get(dst, length, src, offset).Wait(Deadline());
  }

  // Body of PeerProcessKilledMidTransfer, for one kind of peer region.
  void KillPeerMidTransfer(bool allocate);

  // Declared in destruction-safe order: Regions and Connections may outlive
  // their Transports, and tests reset any of them early.
  std::vector<unsigned char> server_memory_;
  std::unique_ptr<Transport> server_;
  std::unique_ptr<Transport> client_;
  std::unique_ptr<Region> region_;
  RegionDescriptor slot_;
  std::unique_ptr<Connection> connection_;
};

TEST_P(TransportConformanceTest, EnforcesRemoteKeysAsTheBackendSays) {
  EXPECT_EQ(server_->enforces_remote_keys(), GetParam().enforces_remote_keys);
  EXPECT_EQ(client_->enforces_remote_keys(), GetParam().enforces_remote_keys);
  // Asking for enforcement refuses exactly the transports without it, with
  // FailedPrecondition.
  BackendOptions options = Options("strict");
  TransportOptions common = options.ucx.common;
  common.require_enforced_remote_keys = true;
  options.SetCommon(common);
  auto strict = CreateTransport(GetParam().transport, options);
  if (GetParam().enforces_remote_keys) {
    ASSERT_TRUE(strict.ok()) << strict.status();
    EXPECT_TRUE((*strict)->enforces_remote_keys());
  } else {
    EXPECT_TRUE(absl::IsFailedPrecondition(strict.status())) << strict.status();
  }
}

TEST_P(TransportConformanceTest, PutThenGetRoundTrip) {
  std::vector<unsigned char> data(64 << 10), back(64 << 10, 0);
  Fill(data.data(), data.size(), 1);
  ASSERT_EQ(PutWait(data.data(), data.size(), slot_, 4096), absl::OkStatus());
  EXPECT_EQ(std::memcmp(server_memory_.data() + 4096, data.data(), data.size()),
            0);
  EXPECT_TRUE(AllBytesAre(server_memory_.data(), 4096, 0));
  ASSERT_EQ(GetWait(back.data(), back.size(), slot_, 4096), absl::OkStatus());
  EXPECT_EQ(back, data);
  EXPECT_EQ(connection_->Flush(Deadline()), absl::OkStatus());
}

TEST_P(TransportConformanceTest, PutsToOneSlotApplyInIssueOrder) {
  constexpr size_t kSlot = 64 << 10;
  // The first Put covers the whole region and is split into pieces; later
  // ones overwrite the first slot; the Get is issued before any is waited on.
  std::vector<unsigned char> big(kRegionBytes, 100);
  std::vector<std::vector<unsigned char>> small;
  for (int k = 1; k <= 16; ++k)
    small.emplace_back(kSlot, static_cast<unsigned char>(k));
  std::vector<unsigned char> seen(kSlot, 0);

  std::vector<Completion> puts;
  puts.push_back(connection_->Put(big.data(), big.size(), slot_, 0));
  for (auto& buffer : small)
    puts.push_back(connection_->Put(buffer.data(), kSlot, slot_, 0));
  Completion get = connection_->Get(seen.data(), kSlot, slot_, 0);
  for (auto& put : puts) ASSERT_EQ(put.Wait(Deadline()), absl::OkStatus());
  ASSERT_EQ(get.Wait(Deadline()), absl::OkStatus());

  EXPECT_TRUE(AllBytesAre(seen.data(), kSlot, 16));
  EXPECT_TRUE(AllBytesAre(server_memory_.data(), kSlot, 16));
  EXPECT_TRUE(
      AllBytesAre(server_memory_.data() + kSlot, kRegionBytes - kSlot, 100));
}

TEST_P(TransportConformanceTest, AllocatedRegionRoundTrip) {
  auto allocated =
      server_->AllocateRegion(kRegionBytes + 3, Access::kRemoteReadWrite);
  ASSERT_TRUE(allocated.ok()) << allocated.status();
  Region& region = **allocated;
  ASSERT_NE(region.base(), nullptr);
  ASSERT_EQ(region.length(), kRegionBytes + 3);
  EXPECT_EQ(region.Descriptor().length, kRegionBytes + 3);
  auto* memory = static_cast<unsigned char*>(region.base());
  EXPECT_TRUE(AllBytesAre(memory, kRegionBytes + 3, 0));

  std::vector<unsigned char> data(kRegionBytes), back(kRegionBytes, 0);
  Fill(data.data(), data.size(), 3);
  ASSERT_EQ(PutWait(data.data(), data.size(), region.Descriptor(), 3),
            absl::OkStatus());
  EXPECT_EQ(std::memcmp(memory + 3, data.data(), data.size()), 0);
  EXPECT_TRUE(AllBytesAre(memory, 3, 0));
  memory[100] ^= 0xFF;  // the owner writes; a Get sees it
  data[97] ^= 0xFF;
  ASSERT_EQ(GetWait(back.data(), back.size(), region.Descriptor(), 3),
            absl::OkStatus());
  EXPECT_TRUE(back == data);
  EXPECT_TRUE(absl::IsInvalidArgument(
      server_->AllocateRegion(0, Access::kRemoteRead).status()));
}

TEST_P(TransportConformanceTest, LargeTransferRoundTrips) {
  std::vector<unsigned char> remote(kLargeBytes, 0);
  auto region = server_->RegisterRegion(remote.data(), remote.size(),
                                        Access::kRemoteReadWrite);
  ASSERT_TRUE(region.ok()) << region.status();
  std::vector<unsigned char> data(kLargeBytes), back(kLargeBytes, 0);
  Fill(data.data(), data.size(), 2);

  ASSERT_EQ(PutWait(data.data(), data.size(), (*region)->Descriptor(), 0),
            absl::OkStatus());
  EXPECT_TRUE(remote == data);
  ASSERT_EQ(GetWait(back.data(), back.size(), (*region)->Descriptor(), 0),
            absl::OkStatus());
  EXPECT_TRUE(back == data);
}

TEST_P(TransportConformanceTest, TinyAndZeroLengthTransfers) {
  const unsigned char one = 0xC3;
  ASSERT_EQ(PutWait(&one, 1, slot_, 12345), absl::OkStatus());
  EXPECT_EQ(server_memory_[12345], 0xC3);
  EXPECT_EQ(server_memory_[12344], 0);
  EXPECT_EQ(server_memory_[12346], 0);
  unsigned char back = 0;
  ASSERT_EQ(GetWait(&back, 1, slot_, 12345), absl::OkStatus());
  EXPECT_EQ(back, 0xC3);
  // The last byte of the region.
  ASSERT_EQ(PutWait(&one, 1, slot_, kRegionBytes - 1), absl::OkStatus());
  EXPECT_EQ(server_memory_[kRegionBytes - 1], 0xC3);

  // Zero bytes: a no-op anywhere inside or at the end, even with no buffer.
  EXPECT_EQ(PutWait(nullptr, 0, slot_, 0), absl::OkStatus());
  EXPECT_EQ(PutWait(&one, 0, slot_, kRegionBytes), absl::OkStatus());
  EXPECT_EQ(GetWait(nullptr, 0, slot_, 17), absl::OkStatus());
  EXPECT_TRUE(
      absl::IsInvalidArgument(PutWait(&one, 0, slot_, kRegionBytes + 1)));
}

TEST_P(TransportConformanceTest, MisalignedOffsetsAndLengths) {
  const std::pair<uint64_t, size_t> cases[] = {
      {1, 1},          {3, 7},        {4095, 4097},
      {65537, 131071}, {777, 333333}, {kRegionBytes - 3, 3}};
  uint64_t seed = 10;
  for (const auto& [offset, length] : cases) {
    SCOPED_TRACE(absl::StrCat("offset ", offset, " length ", length));
    std::memset(server_memory_.data(), 0xAB, kRegionBytes);
    // Source and destination buffers start at odd addresses too.
    std::vector<unsigned char> src(length + 1), dst(length + 2, 0xEE);
    Fill(src.data() + 1, length, ++seed);
    ASSERT_EQ(PutWait(src.data() + 1, length, slot_, offset), absl::OkStatus());
    EXPECT_TRUE(AllBytesAre(server_memory_.data(), offset, 0xAB));
    EXPECT_EQ(
        std::memcmp(server_memory_.data() + offset, src.data() + 1, length), 0);
    EXPECT_TRUE(AllBytesAre(server_memory_.data() + offset + length,
                            kRegionBytes - offset - length, 0xAB));
    ASSERT_EQ(GetWait(dst.data() + 1, length, slot_, offset), absl::OkStatus());
    EXPECT_EQ(dst[0], 0xEE);
    EXPECT_EQ(std::memcmp(dst.data() + 1, src.data() + 1, length), 0);
    EXPECT_EQ(dst[length + 1], 0xEE);
  }
}

TEST_P(TransportConformanceTest, OutOfRangeIsInvalidArgumentAndTouchesNothing) {
  std::memset(server_memory_.data(), 0x5A, kRegionBytes);
  // Both buffers are large enough for every length tried, so a transport
  // that failed to reject would corrupt nothing but would fail the checks.
  std::vector<unsigned char> src(kRegionBytes + 16, 0x11),
      dst(kRegionBytes + 16, 0x22);
  const std::pair<uint64_t, size_t> bad[] = {
      {kRegionBytes - 10, 11},
      {0, kRegionBytes + 1},
      {kRegionBytes, 1},
      {kRegionBytes + 1, 0},
      {std::numeric_limits<uint64_t>::max(), 1},
      {std::numeric_limits<uint64_t>::max() - 3, 8},
  };
  for (const auto& [offset, length] : bad) {
    SCOPED_TRACE(absl::StrCat("offset ", offset, " length ", length));
    Completion put = connection_->Put(src.data(), length, slot_, offset);
    EXPECT_TRUE(put.IsDone());  // rejected before anything is sent
    EXPECT_TRUE(absl::IsInvalidArgument(put.Wait(Deadline())));
    EXPECT_TRUE(
        absl::IsInvalidArgument(GetWait(dst.data(), length, slot_, offset)))
        << "get";
  }
  // A descriptor whose address range wraps, a damaged rkey, a null buffer.
  RegionDescriptor wrapped = slot_;
  wrapped.address = std::numeric_limits<uint64_t>::max() - 16;
  EXPECT_TRUE(absl::IsInvalidArgument(PutWait(src.data(), 8, wrapped, 0)));
  RegionDescriptor damaged = slot_;
  damaged.rkey = "not a key";
  EXPECT_TRUE(absl::IsInvalidArgument(PutWait(src.data(), 8, damaged, 0)));
  damaged = slot_;
  damaged.rkey.back() ^= 0x40;
  damaged.rkey[damaged.rkey.size() / 2] ^= 0x01;
  EXPECT_FALSE(PutWait(src.data(), 8, damaged, 0).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(PutWait(nullptr, 8, slot_, 0)));
  EXPECT_TRUE(absl::IsInvalidArgument(GetWait(nullptr, 8, slot_, 0)));

  EXPECT_TRUE(AllBytesAre(server_memory_.data(), kRegionBytes, 0x5A));
  EXPECT_TRUE(AllBytesAre(dst.data(), dst.size(), 0x22));
  // The connection is still fine.
  EXPECT_EQ(PutWait(src.data(), 8, slot_, 0), absl::OkStatus());
}

TEST_P(TransportConformanceTest, MalformedPeerAddressIsInvalidArgument) {
  EXPECT_TRUE(absl::IsInvalidArgument(
      client_->Connect("definitely not an address", Deadline()).status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(client_->Connect("", Deadline()).status()));
  const std::string& address = server_->LocalAddress();
  EXPECT_TRUE(absl::IsInvalidArgument(
      client_->Connect(address.substr(0, 6), Deadline()).status()));
}

TEST_P(TransportConformanceTest, ConcurrentPutsFromSeveralThreads) {
  constexpr int kThreads = 4;
  constexpr int kPerThread = 64;
  constexpr size_t kSlot = kRegionBytes / (kThreads * kPerThread);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::vector<unsigned char>> buffers(kPerThread);
      std::vector<Completion> pending;
      for (int i = 0; i < kPerThread; ++i) {
        buffers[i].resize(kSlot);
        Fill(buffers[i].data(), kSlot, 1000 + t * kPerThread + i);
        const uint64_t offset = (t * kPerThread + i) * kSlot;
        pending.push_back(
            connection_->Put(buffers[i].data(), kSlot, slot_, offset));
        if (pending.size() == 8) {
          for (auto& c : pending) failures += !c.Wait(Deadline()).ok();
          pending.clear();
        }
      }
      for (auto& c : pending) failures += !c.Wait(Deadline()).ok();
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  std::vector<unsigned char> expected(kSlot);
  for (int slot = 0; slot < kThreads * kPerThread; ++slot) {
    Fill(expected.data(), kSlot, 1000 + slot);
    EXPECT_EQ(std::memcmp(server_memory_.data() + slot * kSlot, expected.data(),
                          kSlot),
              0)
        << "slot " << slot;
  }
}

TEST_P(TransportConformanceTest, DeadlineExpiryDoesNotBlock) {
  std::vector<unsigned char> remote(kLargeBytes);
  auto region = server_->RegisterRegion(remote.data(), remote.size(),
                                        Access::kRemoteReadWrite);
  ASSERT_TRUE(region.ok()) << region.status();
  std::vector<unsigned char> data(kLargeBytes, 7);
  bool saw_deadline = false;
  for (int attempt = 0; attempt < 5 && !saw_deadline; ++attempt) {
    Completion put =
        connection_->Put(data.data(), data.size(), (*region)->Descriptor(), 0);
    const absl::Time start = absl::Now();
    const absl::Status early = put.Wait(absl::InfinitePast());
    EXPECT_LT(absl::Now() - start, absl::Seconds(1));
    EXPECT_TRUE(early.ok() || absl::IsDeadlineExceeded(early)) << early;
    saw_deadline |= absl::IsDeadlineExceeded(early);
    // Still in flight after the expired wait; a later wait completes it.
    ASSERT_EQ(put.Wait(Deadline()), absl::OkStatus());
    EXPECT_TRUE(put.IsDone());
  }
  EXPECT_TRUE(saw_deadline) << "a 64 MiB put never outlived an expired wait";
  const absl::Status flush = connection_->Flush(absl::InfinitePast());
  EXPECT_TRUE(flush.ok() || absl::IsDeadlineExceeded(flush)) << flush;
  EXPECT_EQ(connection_->Flush(Deadline()), absl::OkStatus());
}

TEST_P(TransportConformanceTest, AbortFinishesPromptly) {
  std::vector<unsigned char> remote(kLargeBytes);
  auto region = server_->RegisterRegion(remote.data(), remote.size(),
                                        Access::kRemoteReadWrite);
  ASSERT_TRUE(region.ok()) << region.status();
  std::vector<unsigned char> data(kLargeBytes, 9);
  Completion put =
      connection_->Put(data.data(), data.size(), (*region)->Descriptor(), 0);
  put.Abort();
  const absl::Time start = absl::Now();
  const absl::Status status = put.Wait(Deadline());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_TRUE(status.ok() || absl::IsCancelled(status)) << status;
  put.Abort();  // after completion: a no-op
  EXPECT_EQ(put.Wait(Deadline()), status);

  // Dropping a pending handle aborts it and returns once the buffer is free.
  {
    Completion dropped =
        connection_->Put(data.data(), data.size(), (*region)->Descriptor(), 0);
  }
  // A fresh connection works whatever the abort did to the old one.
  auto again = client_->Connect(server_->LocalAddress(), Deadline());
  ASSERT_TRUE(again.ok()) << again.status();
  const unsigned char byte = 42;
  EXPECT_EQ((*again)->Put(&byte, 1, slot_, 0).Wait(Deadline()),
            absl::OkStatus());
  EXPECT_EQ(server_memory_[0], 42);
}

TEST_P(TransportConformanceTest, ServingTransportDestroyed) {
  const unsigned char byte = 1;
  ASSERT_EQ(PutWait(&byte, 1, slot_, 0), absl::OkStatus());
  const std::string address = server_->LocalAddress();
  server_.reset();  // region_ outlives it, as Regions may

  // Whatever the transport can see, nothing hangs or crashes.
  const absl::Time start = absl::Now();
  std::vector<unsigned char> buffer(4096, 3);
  const absl::Status put = PutWait(buffer.data(), buffer.size(), slot_, 0);
  const absl::Status get = GetWait(buffer.data(), buffer.size(), slot_, 0);
  EXPECT_LT(absl::Now() - start, kDeadline);
  if (GetParam().sees_local_peer_destroyed) {
    EXPECT_TRUE(absl::IsUnavailable(put)) << put;
    EXPECT_TRUE(absl::IsUnavailable(get)) << get;
    EXPECT_THAT(std::string(put.message()), HasSubstr("server"));
  }
  region_.reset();

  // Connecting to the dead address fails (or at worst times out) in time.
  const absl::Time connect_start = absl::Now();
  auto connection = client_->Connect(address, absl::Now() + absl::Seconds(3));
  EXPECT_LT(absl::Now() - connect_start, absl::Seconds(8));
  if (GetParam().sees_local_peer_destroyed) {
    EXPECT_FALSE(connection.ok());
  }

  // The client's own shutdown turns later calls into FailedPrecondition.
  client_.reset();
  EXPECT_TRUE(absl::IsFailedPrecondition(
      PutWait(buffer.data(), buffer.size(), slot_, 0)));
}

TEST_P(TransportConformanceTest, RevokedRegionIsRefused) {
  if (!GetParam().refuses_revoked_region) {
    GTEST_SKIP() << GetParam().label
                 << ": software-emulated RMA cannot tell a revoked region";
  }
  const RegionDescriptor stale = slot_;
  region_.reset();
  std::vector<unsigned char> buffer(4096, 3);
  const absl::Status put = PutWait(buffer.data(), buffer.size(), stale, 0);
  EXPECT_TRUE(absl::IsUnavailable(put)) << put;
  EXPECT_TRUE(AllBytesAre(server_memory_.data(), kRegionBytes, 0));
  EXPECT_TRUE(
      absl::IsUnavailable(GetWait(buffer.data(), buffer.size(), stale, 0)));
}

// A peer in another process, killed while a transfer is in flight.
class PeerProcess {
 public:
  ~PeerProcess() { Kill(); }

  absl::Status Start(const std::string& transport, const std::string& tls,
                     size_t bytes, bool allocate) {
    const char* srcdir = std::getenv("TEST_SRCDIR");
    const char* workspace = std::getenv("TEST_WORKSPACE");
    const std::string binary = absl::StrCat(srcdir ? srcdir : ".", "/",
                                            workspace ? workspace : "zeroshard",
                                            "/transport/transport_test_peer");
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) return absl::InternalError("pipe");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, in[1]);
    posix_spawn_file_actions_addclose(&actions, out[0]);
    const std::string size = std::to_string(bytes);
    std::string allocate_flag = "allocate";
    std::vector<char*> argv = {
        const_cast<char*>(binary.c_str()), const_cast<char*>(transport.c_str()),
        const_cast<char*>(tls.c_str()), const_cast<char*>(size.c_str())};
    if (allocate) argv.push_back(allocate_flag.data());
    argv.push_back(nullptr);
    const int rc = posix_spawn(&pid_, binary.c_str(), &actions, nullptr,
                               argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(in[0]);
    close(out[1]);
    stdin_ = in[1];
    stdout_ = out[0];
    if (rc != 0) {
      pid_ = -1;
      return absl::InternalError(
          absl::StrCat("spawn ", binary, ": ", strerror(rc)));
    }
    std::string line;
    const absl::Time deadline = Deadline();
    while (line.find('\n') == std::string::npos) {
      const int ms =
          static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
      pollfd p{stdout_, POLLIN, 0};
      if (ms <= 0 || poll(&p, 1, ms) <= 0)
        return absl::DeadlineExceededError("peer silent");
      char buffer[4096];
      const ssize_t n = read(stdout_, buffer, sizeof(buffer));
      if (n <= 0)
        return absl::UnavailableError(absl::StrCat("peer exited: ", line));
      line.append(buffer, n);
    }
    line.resize(line.find('\n'));
    if (absl::StartsWith(line, "ERROR")) return absl::UnavailableError(line);
    std::vector<std::string> fields = absl::StrSplit(line, ' ');
    if (fields.size() != 2)
      return absl::InternalError(absl::StrCat("bad line: ", line));
    address_ = absl::HexStringToBytes(fields[0]);
    absl::StatusOr<RegionDescriptor> descriptor =
        DecodeRegionDescriptor(absl::HexStringToBytes(fields[1]));
    if (!descriptor.ok()) return descriptor.status();
    descriptor_ = *descriptor;
    return absl::OkStatus();
  }

  void Kill() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
    if (stdin_ >= 0) close(stdin_);
    if (stdout_ >= 0) close(stdout_);
    stdin_ = stdout_ = -1;
  }

  const std::string& address() const { return address_; }
  const RegionDescriptor& descriptor() const { return descriptor_; }

 private:
  pid_t pid_ = -1;
  int stdin_ = -1, stdout_ = -1;
  std::string address_;
  RegionDescriptor descriptor_;
};

TEST_P(TransportConformanceTest, PeerProcessKilledMidTransfer) {
  if (!GetParam().peer_in_other_process) {
    GTEST_SKIP() << GetParam().label << " has no peer in another process "
                 << "(ServingTransportDestroyed covers its peer loss)";
  }
  for (const bool allocate : {false, true}) {
    SCOPED_TRACE(allocate ? "allocated region" : "registered region");
    KillPeerMidTransfer(allocate);
  }
}

void TransportConformanceTest::KillPeerMidTransfer(bool allocate) {
  PeerProcess peer;
  ASSERT_EQ(peer.Start(GetParam().transport, GetParam().ucx_tls, kLargeBytes,
                       allocate),
            absl::OkStatus());
  auto connection = client_->Connect(peer.address(), Deadline());
  ASSERT_TRUE(connection.ok()) << connection.status();
  EXPECT_EQ((*connection)->peer_name(), "test-peer");

  // Across processes, descriptors and rkeys work as they do in one.
  std::vector<unsigned char> head(4096);
  ASSERT_EQ((*connection)
                ->Get(head.data(), head.size(), peer.descriptor(), 1000)
                .Wait(Deadline()),
            absl::OkStatus());
  for (size_t i = 0; i < head.size(); ++i)
    ASSERT_EQ(head[i], PeerPattern(1000 + i));

  std::vector<unsigned char> data(kLargeBytes, 5);
  Completion put =
      (*connection)->Put(data.data(), data.size(), peer.descriptor(), 0);
  peer.Kill();
  const absl::Time start = absl::Now();
  const absl::Status in_flight = put.Wait(Deadline());
  EXPECT_FALSE(absl::IsDeadlineExceeded(in_flight)) << in_flight;
  EXPECT_TRUE(in_flight.ok() || absl::IsUnavailable(in_flight)) << in_flight;

  // Everything after the death fails, naming the peer, within the deadline.
  for (int i = 0; i < 3; ++i) {
    const absl::Status put_after =
        (*connection)
            ->Put(data.data(), 4096, peer.descriptor(), 0)
            .Wait(Deadline());
    EXPECT_TRUE(absl::IsUnavailable(put_after)) << put_after;
    EXPECT_THAT(std::string(put_after.message()), HasSubstr("test-peer"));
    const absl::Status get_after =
        (*connection)
            ->Get(head.data(), 4096, peer.descriptor(), 0)
            .Wait(Deadline());
    EXPECT_TRUE(absl::IsUnavailable(get_after)) << get_after;
  }
  EXPECT_TRUE(absl::IsUnavailable((*connection)->Flush(Deadline())));
  EXPECT_LT(absl::Now() - start, kDeadline);

  // Reconnecting to the dead address fails in time.
  const absl::Time connect_start = absl::Now();
  auto reconnect =
      client_->Connect(peer.address(), absl::Now() + absl::Seconds(3));
  EXPECT_FALSE(reconnect.ok());
  EXPECT_LT(absl::Now() - connect_start, absl::Seconds(8));

  // The local side is unharmed.
  EXPECT_EQ(PutWait(data.data(), 4096, slot_, 0), absl::OkStatus());
}

INSTANTIATE_TEST_SUITE_P(
    Transports, TransportConformanceTest,
    ::testing::Values(
        TransportCase{"inproc", "inproc", "", false, true, true, true},
        TransportCase{"ucx_tcp", "ucx", "tcp", true, true, false, false},
        TransportCase{"ucx_shm", "ucx", "posix,cma,self", true, true, false,
                      true},
        TransportCase{"grpc", "grpc", "", true, true, true, true}),
    CaseName);

}  // namespace
}  // namespace zeroshard::transport
