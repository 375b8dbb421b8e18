#pragma once

// A Transport that wraps another and makes chosen connections fail the ways
// a real link does, for tests of what the caller does then:
//   kClosed   every Put and Get issued on the connection fails at once with
//             Cancelled, no byte moved: a connection closed under its user
//             (UCX closes one with peer error handling to stop an operation
//             aborted at its deadline).
//   kStalled  every Put and Get issued on the connection stays in flight
//             until aborted (a peer that stopped answering). Aborting one
//             closes the connection as UCX does: it and every other
//             operation still stalled on that connection finish Cancelled,
//             and the connection is kClosed from then on.
// Operations issued in kOpen go to the wrapped transport's connection, as
// does everything else (regions, addresses, Connect).
//
// Connections are numbered from 0 in the order Connect() made them. Each
// connection's Puts and Gets of a nonzero length are counted, whatever the
// mode. Thread-safe; the state outlives the Transport as long as a
// Connection or operation of it does.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace zeroshard::transport::testing {

class FaultyTransport final : public Transport {
 public:
  enum class Mode { kOpen, kClosed, kStalled };

  explicit FaultyTransport(std::unique_ptr<Transport> inner);
  ~FaultyTransport() override;

  // Operations issued on connection `index` (made or yet to be made) from
  // now on behave as `mode`; those already issued keep going as they were.
  void SetMode(int index, Mode mode);
  // How many connections Connect() has made.
  int connections_made() const;
  // Puts and Gets (length > 0) issued on connection `index` so far.
  int operations(int index) const;

  absl::string_view kind() const override;
  absl::StatusOr<std::unique_ptr<Region>> RegisterRegion(void* base, size_t length,
                                                         Access access) override;
  absl::StatusOr<std::unique_ptr<Region>> AllocateRegion(size_t length, Access access) override;
  const std::string& LocalAddress() const override;
  absl::StatusOr<std::unique_ptr<Connection>> Connect(absl::string_view peer_address,
                                                      absl::Time deadline) override;
  bool enforces_remote_keys() const override;

  // Shared with the connections and their stalled operations.
  class Faults;

 private:
  const std::unique_ptr<Transport> inner_;
  const std::shared_ptr<Faults> faults_;
};

}  // namespace zeroshard::transport::testing
