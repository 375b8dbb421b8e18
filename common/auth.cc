#include "common/auth.h"

#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <cstdlib>
#include <cstring>

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
  // The file is opened first and its descriptor checked, so what is checked
  // is what is read (no swap between a stat and the open). Symbolic links
  // are followed: Kubernetes mounts secrets as links into a private
  // directory; the file they lead to must pass the checks. O_NONBLOCK: a
  // FIFO planted at the path does not hang the reader.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": cannot read \"", path, "\": ", std::strerror(errno)));
  }
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": \"", path, "\" is not a regular file"));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": \"", path, "\" is readable by others (mode ",
                     absl::StrCat(absl::Hex(st.st_mode & 0777)), "); chmod 600 it"));
  }
  if (st.st_uid != ::geteuid() && st.st_uid != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": \"", path, "\" belongs to uid ", st.st_uid, ", not to this process (uid ",
        ::geteuid(), ") or root: anyone who owns it can change the token; chown it"));
  }
  std::string text(kMaxTokenLength + 64, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": cannot read \"", path, "\": ", std::strerror(errno)));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  text.resize(got);
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

std::string RegistrationTokenOrEnvironment(const std::string& token) {
  if (!token.empty()) return token;
  const char* v = std::getenv(kRegistrationTokenEnvironment);
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

std::optional<std::string> PresentedRegistrationToken(
    const std::multimap<grpc::string_ref, grpc::string_ref>& client_metadata) {
  auto it = client_metadata.find(kRegistrationMetadataKey);
  if (it == client_metadata.end() || it->second.size() == 0 ||
      it->second.size() > kMaxTokenLength) {
    return std::nullopt;
  }
  return std::string(it->second.data(), it->second.size());
}

}  // namespace zeroshard
