#pragma once

// Test helpers for the activation store on its own: payload patterns, spill
// files on disk and a scratch directory per test.

#include <cstddef>
#include <cstdint>
#include <string>

#include "server/activation/activation_store.h"

namespace zeroshard::testing {

// `bytes` bytes of a pattern determined by `seed`.
std::string PatternBytes(uint64_t seed, size_t bytes);

// Spill files (not locks) in `dir`.
size_t SpillFilesIn(const std::string& dir);
// SpillFilesIn(dir) once `store` has no spill I/O in flight and has removed
// the files it dropped (it waits for its disk to be idle: see
// ActivationStore), within 10 s.
size_t SettledSpillFiles(const ActivationStore& store, const std::string& dir);

// A directory under the test's temporary directory.
std::string TestDir(const std::string& name);

}  // namespace zeroshard::testing
