// libFuzzer target: what a peer controls in a one-sided operation — the
// region descriptor (address, length, rkey, or its byte encoding), the
// offset, the length and the direction — against live regions of an inproc
// transport. A forged or damaged key, a range outside the region, or a Put
// into a read-only region must fail before a byte moves; nothing may touch
// memory outside the regions (ASan) or change a region it may not write.
// Run: tools/fuzz.sh //transport:region_access_fuzzer 60

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "transport/inproc/inproc_transport.h"
#include "transport/transport.h"

namespace {

using zeroshard::transport::Access;
using zeroshard::transport::Connection;
using zeroshard::transport::RegionDescriptor;

constexpr size_t kRegionBytes = 4096;

struct World {
  std::unique_ptr<zeroshard::transport::Transport> owner, peer;
  std::unique_ptr<zeroshard::transport::Region> readable, writable;
  std::unique_ptr<Connection> connection;
  std::vector<uint8_t> readable_bytes;  // what `readable` must keep holding
};

World* world = nullptr;

uint64_t Take(const uint8_t*& p, size_t& n, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes && n > 0; ++i, ++p, --n) v |= uint64_t{*p} << (8 * i);
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const zeroshard::transport::InprocTransportOptions o;
  world = new World;
  world->owner = *zeroshard::transport::inproc::CreateInprocTransport(o);
  world->peer = *zeroshard::transport::inproc::CreateInprocTransport(o);
  world->readable = *world->owner->AllocateRegion(kRegionBytes, Access::kRemoteRead);
  world->writable = *world->owner->AllocateRegion(kRegionBytes, Access::kRemoteWrite);
  world->readable_bytes.resize(kRegionBytes);
  for (size_t i = 0; i < kRegionBytes; ++i) world->readable_bytes[i] = static_cast<uint8_t>(i * 13);
  std::memcpy(world->readable->base(), world->readable_bytes.data(), kRegionBytes);
  world->connection = *world->peer->Connect(world->owner->LocalAddress(),
                                            absl::Now() + absl::Seconds(10));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const uint8_t* p = data;
  size_t n = size;
  const uint64_t mode = Take(p, n, 1);
  const bool put = mode & 1;
  RegionDescriptor d = ((mode >> 1) & 1) ? world->writable->Descriptor()
                                         : world->readable->Descriptor();
  switch ((mode >> 2) & 3) {
    case 0:  // a real descriptor
      break;
    case 1:  // fields changed
      d.address ^= Take(p, n, 8);
      d.length ^= Take(p, n, 8);
      break;
    case 2: {  // rkey bytes changed
      for (size_t i = 0; i < d.rkey.size() && n > 0; ++i) d.rkey[i] ^= static_cast<char>(Take(p, n, 1));
      break;
    }
    case 3: {  // an encoded descriptor from the input
      const size_t len = static_cast<size_t>(Take(p, n, 2)) % (n + 1);
      absl::StatusOr<RegionDescriptor> decoded = zeroshard::transport::DecodeRegionDescriptor(
          absl::string_view(reinterpret_cast<const char*>(p), len));
      p += len;
      n -= len;
      if (!decoded.ok()) return 0;
      // The encoding round-trips.
      if (zeroshard::transport::EncodeRegionDescriptor(*decoded) !=
          std::string(reinterpret_cast<const char*>(p - len), len)) {
        std::abort();
      }
      d = *decoded;
      break;
    }
  }
  const uint64_t offset = Take(p, n, 8) % (2 * kRegionBytes + 1);
  const size_t length = static_cast<size_t>(Take(p, n, 2)) % (2 * kRegionBytes + 1);
  std::vector<uint8_t> local(length, 0xa5);
  zeroshard::transport::Completion c =
      put ? world->connection->Put(local.data(), length, d, offset)
          : world->connection->Get(local.data(), length, d, offset);
  const absl::Status s = c.Wait(absl::Now() + absl::Seconds(10));
  const bool genuine = d.rkey == world->readable->Descriptor().rkey ||
                       d.rkey == world->writable->Descriptor().rkey;
  if (s.ok() && length > 0) {
    // Only a genuine key, in an allowed direction, and only bytes of its
    // region: the address the operation reached (the descriptor's address,
    // which a peer may shift, plus the offset) lies within the region.
    const bool to_writable = d.rkey == world->writable->Descriptor().rkey;
    const zeroshard::transport::Region& region = to_writable ? *world->writable : *world->readable;
    const uint64_t base = reinterpret_cast<uintptr_t>(region.base());
    const uint64_t reached = d.address + offset;
    if (!genuine || put != to_writable || reached < base || reached - base > kRegionBytes ||
        length > kRegionBytes - (reached - base)) {
      std::abort();
    }
  }
  // The read-only region never changes.
  if (std::memcmp(world->readable->base(), world->readable_bytes.data(), kRegionBytes) != 0) {
    std::abort();
  }
  return 0;
}
