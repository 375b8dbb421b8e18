#pragma once

// The baseline of the transport benchmarks: `ucx_perftest -t ucp_put_bw`
// between two processes on this host, as UCX itself measures one-sided put
// bandwidth.

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard::bench {

// Runs a `binary` (ucx_perftest) server and client on loopback with UCX_TLS
// = `ucx_tls`, `size`-byte messages, and returns the client's overall
// bandwidth in GB/s (10^9 bytes). Up to three attempts; NaN with *why set
// when none gave a result. Blocks up to about two minutes per attempt.
double PerftestPutGbps(uint64_t size, const std::string& binary, const std::string& ucx_tls,
                       std::string* why);
// PerftestPutGbps up to `runs` times (at least once), stopping at the first
// that gives no result (*why says why): the figures of the runs that did.
std::vector<double> PerftestPutRuns(uint64_t size, const std::string& binary,
                                    const std::string& ucx_tls, int runs, std::string* why);

}  // namespace zeroshard::bench
