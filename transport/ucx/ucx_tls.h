#pragma once

// Whether the "ucx" transport enforces remote keys (Transport::
// enforces_remote_keys()), decided from what UCX_TLS asks for and from the
// transport resources UCX actually selected for it.
//
// A key is as good as enforced only where the processes that can reach
// this one may read its memory anyway (shared memory on this host: posix,
// sysv, xpmem, knem, cma, self; same user, cma needs ptrace rights). Over
// tcp UCX emulates remote access in software: its progress thread reads or
// writes whatever address a request names, so a forged or reused key
// reaches any memory of the process. Over RDMA (rc, dc, ud and their
// variants) the adapter checks the keys of the accesses it carries, but
// UCX (with remote access enabled) also serves put and get messages on
// every connection, whatever the transport, that name an address and carry
// no key: a peer that sends them itself (a UCX of its own making) reaches
// any memory of the process, so RDMA does not count either.
//
// Pure functions on strings: no UCX, no state.

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace zeroshard::transport::ucx {

// The transport names (UCT's, e.g. "self", "posix", "tcp", "rc_mlx5") of the
// resource lines in `context_info`, the text ucp_context_print_info() writes
// ("#      resource 1  :  md 1  dev 1  flags -- tcp/eth0"), in order, once
// each. Empty when there is no such line.
std::vector<std::string> SelectedTransports(absl::string_view context_info);

struct KeyEnforcement {
  bool enforced = false;
  // When !enforced: why, in a sentence naming the UCX_TLS value and the
  // transport that decided it; empty otherwise.
  std::string reason;
};

// The first half of DecideKeyEnforcement(), for before UCX is initialised:
// whether `tls` names only transports of the kind above.
KeyEnforcement CheckRequestedTls(absl::string_view tls);

// Enforced iff both:
// - `tls`, the UCX_TLS value in effect, names only transports of the kinds
//   above (their UCX_TLS names and aliases: "posix,cma,self", "sm", "rc_x",
//   "ib", ...). An empty value, "all" or an exclusion list ("^tcp") leaves
//   the choice to UCX and the devices it finds on each host, and does not
//   count, whatever UCX picked here;
// - every transport in `selected` (SelectedTransports()) is one of them, and
//   there is at least one.
KeyEnforcement DecideKeyEnforcement(absl::string_view tls,
                                    const std::vector<std::string>& selected);

}  // namespace zeroshard::transport::ucx
