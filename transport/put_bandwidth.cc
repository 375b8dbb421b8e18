// Single-threaded Put bandwidth per transport, against memcpy in the same
// run. Both sides live in this process (two Transports), each with its own
// progress thread.
//
//   put_bandwidth [message_bytes [seconds_per_case]]
//
// For each case it prints GB/s with one Put in flight (wait for each) and with
// four in flight, and the ratio to memcpy of the same message size; the last
// line names the fastest case and its ratio to memcpy.

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace zeroshard::transport {
namespace {

constexpr size_t kRegionBytes = size_t{64} << 20;

struct Case {
  const char* label;
  const char* transport;
  const char* tls;
  bool allocate;  // AllocateRegion instead of RegisterRegion
};

double Gbps(size_t bytes, absl::Duration elapsed) {
  return static_cast<double>(bytes) / absl::ToDoubleSeconds(elapsed) / 1e9;
}

double MemcpyGbps(size_t message, absl::Duration budget) {
  std::vector<char> src(message, 1), dst(kRegionBytes);
  size_t moved = 0, offset = 0;
  const absl::Time start = absl::Now();
  while (absl::Now() - start < budget) {
    std::memcpy(dst.data() + offset, src.data(), message);
    // dst is never read: without this the compiler drops the copy.
    asm volatile("" : : "r"(dst.data()) : "memory");
    moved += message;
    offset = (offset + message) % (kRegionBytes - message + 1);
  }
  return Gbps(moved, absl::Now() - start);
}

// GB/s, or a negative number after printing why the case could not run.
double PutGbps(Connection& connection, const RegionDescriptor& dst,
               const std::vector<char>& src, int depth, absl::Duration budget) {
  const size_t message = src.size();
  std::deque<Completion> pending;
  size_t moved = 0, offset = 0;
  const absl::Time start = absl::Now();
  while (absl::Now() - start < budget) {
    pending.push_back(connection.Put(src.data(), message, dst, offset));
    offset = (offset + message) % (kRegionBytes - message + 1);
    if (static_cast<int>(pending.size()) >= depth) {
      const absl::Status status =
          pending.front().Wait(absl::Now() + absl::Seconds(30));
      if (!status.ok()) {
        std::printf("    put failed: %s\n", status.ToString().c_str());
        return -1;
      }
      pending.pop_front();
      moved += message;
    }
  }
  for (auto& c : pending) {
    const absl::Status status = c.Wait(absl::Now() + absl::Seconds(30));
    if (!status.ok()) {
      std::printf("    put failed: %s\n", status.ToString().c_str());
      return -1;
    }
    moved += message;
  }
  return Gbps(moved, absl::Now() - start);
}

int Main(int argc, char** argv) {
  size_t message = size_t{4} << 20;
  double seconds = 1.0;
  if (argc > 1 && (!absl::SimpleAtoi(argv[1], &message) || message == 0 ||
                   message > kRegionBytes)) {
    std::fprintf(stderr, "usage: %s [message_bytes <= 64 MiB [seconds]]\n",
                 argv[0]);
    return 2;
  }
  if (argc > 2 && !absl::SimpleAtod(argv[2], &seconds)) return 2;
  const absl::Duration budget = absl::Seconds(seconds);

  const double baseline = MemcpyGbps(message, budget);
  std::printf("message %zu bytes; baseline memcpy: %.2f GB/s\n", message,
              baseline);
  std::printf("%-28s %12s %12s %10s\n", "case", "1 in flight", "4 in flight",
              "vs memcpy");

  const Case cases[] = {
      {"inproc", "inproc", "", false},
      {"ucx shm (registered)", "ucx", "posix,cma,self", false},
      {"ucx shm (allocated)", "ucx", "posix,cma,self", true},
      {"ucx tcp (registered)", "ucx", "tcp", false},
      {"ucx tcp (allocated)", "ucx", "tcp", true},
      {"grpc (registered)", "grpc", "", false},
      {"grpc (allocated)", "grpc", "", true},
  };
  double best = 0;
  std::string best_label = "none";
  for (const Case& c : cases) {
    BackendOptions options;
    options.ucx.tls = c.tls;
    auto server = CreateTransport(c.transport, options);
    auto client = CreateTransport(c.transport, options);
    if (!server.ok() || !client.ok()) {
      std::printf(
          "%-28s skipped: %s\n", c.label,
          (server.ok() ? client.status() : server.status()).ToString().c_str());
      continue;
    }
    std::vector<char> memory;
    absl::StatusOr<std::unique_ptr<Region>> region;
    if (c.allocate) {
      region = (*server)->AllocateRegion(kRegionBytes, Access::kRemoteWrite);
    } else {
      memory.assign(kRegionBytes, 0);
      region = (*server)->RegisterRegion(memory.data(), kRegionBytes,
                                         Access::kRemoteWrite);
    }
    auto connection = (*client)->Connect((*server)->LocalAddress(),
                                         absl::Now() + absl::Seconds(10));
    if (!region.ok() || !connection.ok()) {
      std::printf("%-28s skipped: %s\n", c.label,
                  (region.ok() ? connection.status() : region.status())
                      .ToString()
                      .c_str());
      continue;
    }
    std::vector<char> src(message, 7);
    const double one =
        PutGbps(**connection, (*region)->Descriptor(), src, 1, budget);
    const double four =
        PutGbps(**connection, (*region)->Descriptor(), src, 4, budget);
    std::printf("%-28s %9.2f GB/s %7.2f GB/s %9.2fx\n", c.label, one, four,
                one / baseline);
    if (std::max(one, four) > best) {
      best = std::max(one, four);
      best_label = c.label;
    }
  }
  std::printf("best=\"%s\" best_put_gbps=%.3f memcpy_gbps=%.3f ratio=%.3f\n", best_label.c_str(),
              best, baseline, best / baseline);
  return 0;
}

}  // namespace
}  // namespace zeroshard::transport

int main(int argc, char** argv) {
  return zeroshard::transport::Main(argc, argv);
}
