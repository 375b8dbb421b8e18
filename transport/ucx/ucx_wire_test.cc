#include "transport/ucx/ucx_wire.h"

#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace zeroshard::transport::ucx {
namespace {

PeerIdentity SampleIdentity() {
  PeerIdentity identity;
  identity.boot = 0x0123456789abcdefull;
  identity.pid = 0xfedcba98u;
  identity.start_time = 0x1122334455667788ull;
  identity.instance = 0x8877665544332211ull;
  return identity;
}

// Bytes that look like UCX's packed ones, including zeros and high bytes.
std::string SamplePacked(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(i * 37 + 11);
  return s;
}

TEST(UcxWireTest, AddressRoundTrips) {
  const std::string worker = SamplePacked(61);
  const std::string encoded = EncodeAddress(SampleIdentity(), worker, "zeroshardd 127.0.0.1:7070");
  EXPECT_EQ(encoded.size(), kEnvelopeBytes + kIdentityBytes + worker.size() + 25);
  absl::StatusOr<PeerAddress> decoded = DecodeAddress(encoded, "address");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->identity, SampleIdentity());
  EXPECT_EQ(decoded->worker_address, worker);
  EXPECT_EQ(decoded->name, "zeroshardd 127.0.0.1:7070");
}

TEST(UcxWireTest, AddressWithoutNameRoundTrips) {
  const std::string encoded = EncodeAddress(SampleIdentity(), "w", "");
  absl::StatusOr<PeerAddress> decoded = DecodeAddress(encoded, "address");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->worker_address, "w");
  EXPECT_TRUE(decoded->name.empty());
}

TEST(UcxWireTest, RkeyRoundTrips) {
  const std::string packed = SamplePacked(200);
  const std::string encoded = EncodeRkey(packed);
  EXPECT_EQ(encoded.size(), kEnvelopeBytes + packed.size());
  absl::StatusOr<absl::string_view> decoded = DecodeRkey(encoded, "rkey");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, packed);
}

TEST(UcxWireTest, EncodingIsLittleEndianMagicLengthPayloadChecksum) {
  const std::string encoded = EncodeRkey("abc");
  ASSERT_EQ(encoded.size(), 4u + 4u + 3u + 8u);
  EXPECT_EQ(encoded.substr(0, 4), "ZSUK");
  EXPECT_EQ(encoded.substr(4, 4), std::string("\x03\x00\x00\x00", 4));
  EXPECT_EQ(encoded.substr(8, 3), "abc");
  // FNV-1a 64 of "abc".
  EXPECT_EQ(encoded.substr(11), std::string("\x4b\x57\x41\x05\x19\xa2\x1f\xe7", 8));
  EXPECT_EQ(EncodeAddress({}, "w", "").substr(0, 4), "ZSUA");
}

void ExpectRefused(const absl::Status& status, const std::string& text) {
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_NE(status.message().find(text), absl::string_view::npos) << status;
}

TEST(UcxWireTest, KindsAreNotInterchangeable) {
  const std::string address = EncodeAddress(SampleIdentity(), "worker", "n");
  const std::string rkey = EncodeRkey(SamplePacked(40));
  ExpectRefused(DecodeRkey(address, "rkey").status(), "rkey (");
  ExpectRefused(DecodeAddress(rkey, "address").status(), "not a UCX one");
}

TEST(UcxWireTest, EmptyAndShortInputsAreRefused) {
  ExpectRefused(DecodeAddress("", "address").status(), "(0 bytes)");
  ExpectRefused(DecodeRkey("", "rkey").status(), "(0 bytes)");
  ExpectRefused(DecodeRkey("ZSUK", "rkey").status(), "not a UCX one");
}

TEST(UcxWireTest, EveryTruncationIsRefused) {
  const std::string address = EncodeAddress(SampleIdentity(), "worker", "");
  for (size_t n = 0; n < address.size(); ++n) {
    EXPECT_TRUE(absl::IsInvalidArgument(DecodeAddress(address.substr(0, n), "address").status()))
        << n;
  }
  const std::string rkey = EncodeRkey(SamplePacked(40));
  for (size_t n = 0; n < rkey.size(); ++n) {
    EXPECT_TRUE(absl::IsInvalidArgument(DecodeRkey(rkey.substr(0, n), "rkey").status())) << n;
  }
}

TEST(UcxWireTest, OverlongLengthIsRefused) {
  std::string rkey = EncodeRkey(SamplePacked(40));
  rkey[7] = '\x80';  // claims 2 GiB more than it has
  ExpectRefused(DecodeRkey(rkey, "rkey").status(), "claims 2147483688");
  rkey[4] = rkey[5] = rkey[6] = rkey[7] = '\xff';
  ExpectRefused(DecodeRkey(rkey, "rkey").status(), "claims 4294967295");
}

// Each bit of the magic, length, payload and checksum is covered: a flip
// anywhere in the envelope is refused (only an address's name, after the
// envelope, is unchecked).
TEST(UcxWireTest, EveryBitFlipInTheEnvelopeIsRefused) {
  const std::string address = EncodeAddress(SampleIdentity(), "worker", "");
  for (size_t i = 0; i < address.size() * 8; ++i) {
    std::string damaged = address;
    damaged[i / 8] ^= static_cast<char>(1 << (i % 8));
    EXPECT_TRUE(absl::IsInvalidArgument(DecodeAddress(damaged, "address").status())) << "bit " << i;
  }
  const std::string rkey = EncodeRkey(SamplePacked(40));
  for (size_t i = 0; i < rkey.size() * 8; ++i) {
    std::string damaged = rkey;
    damaged[i / 8] ^= static_cast<char>(1 << (i % 8));
    EXPECT_TRUE(absl::IsInvalidArgument(DecodeRkey(damaged, "rkey").status())) << "bit " << i;
  }
}

TEST(UcxWireTest, ChecksumMismatchIsNamed) {
  std::string rkey = EncodeRkey(SamplePacked(40));
  rkey[10] ^= 0x01;
  ExpectRefused(DecodeRkey(rkey, "rkey").status(), "rkey: checksum mismatch");
  std::string address = EncodeAddress(SampleIdentity(), "worker", "name");
  address[address.size() - 4 - 1] ^= 0x01;  // the checksum's last byte
  ExpectRefused(DecodeAddress(address, "address").status(), "address: checksum mismatch");
}

TEST(UcxWireTest, AddressWithoutWorkerAddressIsRefused) {
  ExpectRefused(DecodeAddress(EncodeAddress(SampleIdentity(), "", "name"), "address").status(),
                "too short (28 payload bytes)");
  // A valid envelope whose payload is shorter than an identity.
  ExpectRefused(DecodeAddress(EncodeRkey("x").replace(0, 4, "ZSUA"), "address").status(),
                "too short (1 payload bytes)");
}

TEST(UcxWireTest, EmptyRkeyIsRefused) {
  ExpectRefused(DecodeRkey(EncodeRkey(""), "rkey").status(), "rkey: empty");
}

TEST(UcxWireTest, BytesAfterAnRkeyAreRefused) {
  ExpectRefused(DecodeRkey(EncodeRkey("key") + "x", "rkey").status(), "1 bytes after the envelope");
}

}  // namespace
}  // namespace zeroshard::transport::ucx
