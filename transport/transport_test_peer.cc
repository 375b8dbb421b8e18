// A transport peer in its own process, for tests that need to kill one.
//
//   transport_test_peer <transport> <ucx_tls> <region_bytes> [allocate]
//
// <transport> is any linked-in one: "inproc", "ucx" or "grpc" (which serves
// on loopback, any port; it ignores <ucx_tls>).
// Creates the transport (named "test-peer"), registers (or, with "allocate",
// allocates) one read-write region of <region_bytes> bytes whose byte i is
// (i * 131 + 7) mod 256, prints
//   <hex LocalAddress()> <hex EncodeRegionDescriptor(region)>\n
// on stdout, then serves until stdin reaches EOF. On failure it prints
//   ERROR <message>\n
// and exits with status 2.

#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "transport/transport.h"

int main(int argc, char** argv) {
  using zeroshard::transport::Access;
  using zeroshard::transport::CreateTransport;
  using zeroshard::transport::EncodeRegionDescriptor;
  using zeroshard::transport::Region;
  using zeroshard::transport::BackendOptions;
  using zeroshard::transport::TransportOptions;

  size_t bytes = 0;
  if ((argc != 4 && argc != 5) || !absl::SimpleAtoi(argv[3], &bytes) ||
      bytes == 0 || (argc == 5 && std::string(argv[4]) != "allocate")) {
    std::printf(
        "ERROR usage: %s <transport> <ucx_tls> <region_bytes> [allocate]\n",
        argv[0]);
    return 2;
  }
  const bool allocate = argc == 5;
  TransportOptions common;
  common.name = "test-peer";
  BackendOptions options;
  options.SetCommon(common);
  options.ucx.tls = argv[2];
  auto transport = CreateTransport(argv[1], options);
  if (!transport.ok()) {
    std::printf("ERROR %s\n", transport.status().ToString().c_str());
    return 2;
  }
  std::vector<unsigned char> memory;
  absl::StatusOr<std::unique_ptr<Region>> region;
  if (allocate) {
    region = (*transport)->AllocateRegion(bytes, Access::kRemoteReadWrite);
  } else {
    memory.resize(bytes);
    region = (*transport)
                 ->RegisterRegion(memory.data(), memory.size(),
                                  Access::kRemoteReadWrite);
  }
  if (!region.ok()) {
    std::printf("ERROR %s\n", region.status().ToString().c_str());
    return 2;
  }
  auto* base = static_cast<unsigned char*>((*region)->base());
  for (size_t i = 0; i < bytes; ++i) {
    base[i] = static_cast<unsigned char>(i * 131 + 7);
  }
  std::printf(
      "%s %s\n", absl::BytesToHexString((*transport)->LocalAddress()).c_str(),
      absl::BytesToHexString(EncodeRegionDescriptor((*region)->Descriptor()))
          .c_str());
  std::fflush(stdout);
  char c;
  while (read(STDIN_FILENO, &c, 1) > 0) {
  }
  return 0;
}
