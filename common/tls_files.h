#pragma once

// The files of zeroshard's mutual TLS (common/tls.h makes gRPC credentials
// of them), and which addresses only this host can reach. No gRPC here: the
// bulk transports' options carry these.

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

struct TlsFiles {
  std::string cert;  // this side's certificate (chain), PEM
  std::string key;   // its private key, PEM
  std::string ca;    // the CA bundle that signs the peers' certificates, PEM
  // All three empty: plaintext (loopback and tests only; see the daemon's
  // --insecure).
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// `files`, with each empty field taken from the environment: ZS_TLS_CERT,
// ZS_TLS_KEY, ZS_TLS_CA.
TlsFiles TlsFilesFromEnvironment(TlsFiles files);

// OK for none or all three set and readable; InvalidArgument naming the
// field as `prefix` + its name ("--tls_key: ...") otherwise.
absl::Status ValidateTlsFiles(const TlsFiles& files, absl::string_view prefix);

// True for addresses only this host can reach: 127.0.0.0/8, [::1] (and
// [::ffff:127.x.y.z]), localhost (HOST:PORT or HOST alone; a bare IPv6
// address needs its brackets), and unix sockets (unix:PATH).
bool IsLoopbackAddress(absl::string_view address);

// A caller's side of the same rule (docs/security.md): a process that sends
// a token to `address` in plaintext (`tls` false) asks for it to be read
// on the way unless the address is loopback. OK for TLS, for a loopback
// address, or with `insecure` (the caller said so explicitly);
// InvalidArgument otherwise, starting with `field`, naming the address and
// both ways out: `tls_fix` (the TLS files) and `insecure_fix`.
absl::Status CheckPlaintextAddress(absl::string_view address, bool tls, bool insecure,
                                   absl::string_view field, absl::string_view tls_fix,
                                   absl::string_view insecure_fix);

// The explicit opt-in to plaintext on the network for clients: "1" in this
// variable (as the daemon's --insecure).
inline constexpr char kInsecureEnvironment[] = "ZS_INSECURE";
// `insecure`, or ZS_INSECURE=1 in the environment.
bool InsecureOrEnvironment(bool insecure);

}  // namespace zeroshard
