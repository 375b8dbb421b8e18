#pragma once

// Job tokens and the admin token: shared secrets a caller presents on every
// gRPC call as the metadata "authorization: Bearer <token>". A daemon keeps
// only each secret's SHA-256 and compares digests in constant time.
//
// A job's token is chosen by whoever starts the job (zsrun generates one per
// run and hands it to the trainers as ZS_JOB_TOKEN); the first RegisterJob
// binds it to the job, and every later job-scoped call must present it. The
// admin token (zeroshardd --admin_token_file) opens every job, Admin.Drain
// and the all-jobs views.
//
// Nothing here keeps state; ReadTokenFile blocks on disk.

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/string_ref.h"

namespace zeroshard {

// The metadata key (gRPC keys are lower case) and the value's scheme.
inline constexpr char kAuthorizationMetadataKey[] = "authorization";
inline constexpr char kBearerPrefix[] = "Bearer ";

// Tokens are 16..256 printable ASCII characters without spaces.
inline constexpr size_t kMinTokenLength = 16;
inline constexpr size_t kMaxTokenLength = 256;

// The environment variable trainers read their job token from.
inline constexpr char kJobTokenEnvironment[] = "ZS_JOB_TOKEN";

// The deployment's registration token (zeroshardd --registration_token_file):
// a RegisterJob that creates a job carries it under this metadata key; the
// client reads it from ClientConfig.registration_token or this variable.
inline constexpr char kRegistrationMetadataKey[] = "x-zeroshard-registration";
inline constexpr char kRegistrationTokenEnvironment[] = "ZS_REGISTRATION_TOKEN";

// OK, or InvalidArgument naming `what` and what a token must look like.
absl::Status ValidateToken(absl::string_view token, absl::string_view what);

// A fresh token: 32 bytes from the system's CSPRNG, as 64 hex digits.
// Internal error when the CSPRNG fails.
absl::StatusOr<std::string> GenerateToken();

// The token in `path`, surrounding whitespace stripped. InvalidArgument
// naming `what` when the file cannot be read, is not a regular file, is
// group- or world-accessible (it must be mode 0600 or stricter), belongs to
// neither this process's user nor root, or does not hold a valid token.
// Links are followed; the checks apply to the file opened.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path, absl::string_view what);

// `token`, or ZS_JOB_TOKEN from the environment when `token` is empty.
std::string JobTokenOrEnvironment(const std::string& token);
// `token`, or ZS_REGISTRATION_TOKEN from the environment when `token` is empty.
std::string RegistrationTokenOrEnvironment(const std::string& token);

class TokenDigest {
 public:
  // SHA-256 of `token`.
  static TokenDigest Of(absl::string_view token);
  // Constant time in the digest (and so independent of where tokens differ).
  bool Matches(const TokenDigest& other) const;
  // 64 lower-case hex digits, and back (nullopt for anything else).
  std::string ToHex() const;
  static std::optional<TokenDigest> FromHex(absl::string_view hex);

 private:
  std::array<uint8_t, 32> bytes_{};
};

// The token a caller presented ("authorization: Bearer <token>"), nullopt
// when there is none or the value is not a bearer token.
std::optional<std::string> PresentedToken(
    const std::multimap<grpc::string_ref, grpc::string_ref>& client_metadata);
// The registration token a caller presented (kRegistrationMetadataKey),
// nullopt when there is none or it is longer than a token may be.
std::optional<std::string> PresentedRegistrationToken(
    const std::multimap<grpc::string_ref, grpc::string_ref>& client_metadata);

}  // namespace zeroshard
