#include "common/auth.h"

#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <sys/stat.h>

#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace zeroshard {

absl::Status ValidateToken(absl::string_view token, absl::string_view what) {
  if (token.size() < kMinTokenLength || token.size() > kMaxTokenLength) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a token is ", kMinTokenLength, " to ", kMaxTokenLength,
                     " characters, got ", token.size(), " (generate one with `zsctl token`)"));
  }
  for (char c : token) {
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": a token is printable ASCII without spaces (generate one with `zsctl token`)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> GenerateToken() {
  unsigned char bytes[32];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) {
    return absl::InternalError("the system's random number generator failed");
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path, absl::string_view what) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": cannot read \"", path, "\""));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": \"", path, "\" is readable by others (mode ",
                     absl::StrCat(absl::Hex(st.st_mode & 0777)), "); chmod 600 it"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(what, ": cannot read \"", path, "\""));
  std::string text(kMaxTokenLength + 64, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  std::string token(absl::StripAsciiWhitespace(text));
  if (absl::Status s = ValidateToken(token, absl::StrCat(what, " \"", path, "\"")); !s.ok()) {
    return s;
  }
  return token;
}

std::string JobTokenOrEnvironment(const std::string& token) {
  if (!token.empty()) return token;
  const char* v = std::getenv(kJobTokenEnvironment);
  return v == nullptr ? std::string() : std::string(v);
}

TokenDigest TokenDigest::Of(absl::string_view token) {
  TokenDigest d;
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), d.bytes_.data());
  return d;
}

bool TokenDigest::Matches(const TokenDigest& other) const {
  return CRYPTO_memcmp(bytes_.data(), other.bytes_.data(), bytes_.size()) == 0;
}

std::string TokenDigest::ToHex() const {
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes_.data()), bytes_.size()));
}

std::optional<TokenDigest> TokenDigest::FromHex(absl::string_view hex) {
  if (hex.size() != 2 * sizeof(bytes_)) return std::nullopt;
  for (char c : hex) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return std::nullopt;
  }
  const std::string bytes = absl::HexStringToBytes(hex);
  TokenDigest d;
  std::memcpy(d.bytes_.data(), bytes.data(), d.bytes_.size());
  return d;
}

std::optional<std::string> PresentedToken(
    const std::multimap<grpc::string_ref, grpc::string_ref>& client_metadata) {
  auto it = client_metadata.find(kAuthorizationMetadataKey);
  if (it == client_metadata.end()) return std::nullopt;
  absl::string_view value(it->second.data(), it->second.size());
  if (!absl::ConsumePrefix(&value, kBearerPrefix) || value.empty() ||
      value.size() > kMaxTokenLength) {
    return std::nullopt;
  }
  return std::string(value);
}

}  // namespace zeroshard
