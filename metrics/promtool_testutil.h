#pragma once

// Test helpers: Prometheus's promtool, and plain HTTP requests on loopback.
//
// Runs Prometheus's promtool from tests. Tests skip (GTEST_SKIP) when
// FindPromtool() returns "", so they pass where the prometheus package is
// not installed; CI installs it.

#include <string>

#include "absl/strings/string_view.h"

namespace zeroshard::metrics::testing {

// promtool from $PATH, else /usr/bin/promtool, else "".
std::string FindPromtool();

struct CommandResult {
  int exit_code = -1;  // -1: could not run.
  std::string output;  // stdout and stderr together.
};

// Runs `promtool <args>` (args are passed through the shell) with `input` on
// stdin. Blocks until promtool exits.
CommandResult RunPromtool(const std::string& promtool, const std::string& args,
                          absl::string_view input);

// The contents of a data file of the test, `path` relative to the workspace
// root (through $TEST_SRCDIR/$TEST_WORKSPACE under `bazel test`); "" when
// unreadable.
std::string ReadRunfile(const std::string& path);

struct HttpResponse {
  int status = 0;
  std::string headers;  // Status line and headers, CRLF-separated.
  std::string body;
};

// One HTTP/1.0 request to 127.0.0.1:port over a plain socket; reads until
// the server closes (10 s socket timeouts). Returns status 0 when anything
// fails.
HttpResponse Fetch(int port, const std::string& method, const std::string& path);

}  // namespace zeroshard::metrics::testing
