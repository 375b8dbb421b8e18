#pragma once

// The pieces of one Put or Get, for transport implementations: the side that
// sends an operation's bytes cuts them into pieces of at most
// TransportOptions::max_piece_bytes (UCX: one RMA request each; grpc: one
// stream message each, both ways; inproc: one memcpy each), in order, and the
// side that receives pieces whose sizes a peer chose (grpc) takes them in
// order, refusing any byte past the operation's length.
//
// Plain data: no locks, no allocation; one thread at a time.

#include <algorithm>
#include <cstdint>

namespace zeroshard::transport {

class PiecePlan {
 public:
  struct Piece {
    uint64_t offset = 0;  // from the operation's first byte
    uint64_t length = 0;
  };

  // Nothing to move: done().
  PiecePlan() = default;
  // `length` bytes in pieces of at most `piece_bytes`; 0: one piece, however
  // long (a receiver that takes what arrives).
  explicit PiecePlan(uint64_t length, uint64_t piece_bytes = 0)
      : length_(length), piece_bytes_(piece_bytes == 0 ? length : piece_bytes) {}

  uint64_t length() const { return length_; }
  // Bytes handed out or taken so far: the next piece's offset.
  uint64_t offset() const { return offset_; }
  uint64_t remaining() const { return length_ - offset_; }
  bool done() const { return offset_ == length_; }

  // Sender: the next piece, at most `piece_bytes` and at least 1 byte while
  // !done(); an empty piece at offset length() once done().
  Piece Next() {
    const Piece piece{offset_, std::min(piece_bytes_, remaining())};
    offset_ += piece.length;
    return piece;
  }

  // Receiver: takes the next `n` bytes that arrived. False, taking nothing,
  // when they would run past length().
  bool Take(uint64_t n) {
    if (n > remaining()) return false;
    offset_ += n;
    return true;
  }

 private:
  uint64_t length_ = 0;
  uint64_t piece_bytes_ = 0;
  uint64_t offset_ = 0;
};

// The piece length that splits `length` bytes into parts for movers that
// run side by side (one per connection), for PiecePlan(length, it): with
// n = max(1, min(`max_parts`, `length` / `min_part_bytes`)) (`max_parts`
// when `min_part_bytes` is 0), ceil(`length` / n) rounded up to a multiple
// of `align` (0 counts as 1), so at most n parts, all that length but the
// last, which takes the rest; `length` itself when n is 1.
inline uint64_t PartBytes(uint64_t length, uint64_t max_parts, uint64_t min_part_bytes,
                          uint64_t align) {
  const uint64_t most = std::max<uint64_t>(max_parts, 1);
  const uint64_t parts =
      std::clamp<uint64_t>(min_part_bytes == 0 ? most : length / min_part_bytes, 1, most);
  if (parts == 1) return length;
  align = std::max<uint64_t>(align, 1);
  // n >= 2, so `even` <= 2^63, and its round-up is `align` itself or below
  // `even` + `align`: no overflow.
  const uint64_t even = length / parts + (length % parts != 0);
  return even + (align - even % align) % align;
}

}  // namespace zeroshard::transport
