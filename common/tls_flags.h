#pragma once

// The --tls_cert, --tls_key and --tls_ca flags of zeroshard's binaries
// (zeroshardd, zsctl, gpt_train): linking this library defines them.

#include "common/tls.h"

namespace zeroshard {

// The three flags, each empty one taken from ZS_TLS_CERT / ZS_TLS_KEY /
// ZS_TLS_CA. Call after absl::ParseCommandLine.
TlsFiles TlsFilesFromFlags();

}  // namespace zeroshard
