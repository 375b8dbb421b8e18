#pragma once

// Bulk byte transport between a trainer and a shard daemon: register memory,
// publish a descriptor, one-sided Put/Get with completion.
//
// The serving side (a daemon) registers (or allocates) regions and sends,
// over the control plane, its LocalAddress() and each region's
// RegionDescriptor; both are plain bytes and integers that fit in a protobuf.
// The initiating side (a trainer) Connect()s to that address and issues Put
// (into a region) and Get (out of one). The serving application does nothing
// per operation; at most its Transport's progress thread serves it.
//
// Threads: every method here is thread-safe unless stated otherwise. Each
// Transport owns its progress thread(s); callers never drive progress, and
// completions are signalled from those threads. Nothing in this API blocks
// without a deadline, except destructors, which wait a bounded time.
//
// Errors (one meaning per code):
//   InvalidArgument   caller's input (range outside a descriptor, malformed
//                     address or descriptor, null buffer) - nothing was sent;
//   PermissionDenied  the region does not allow that direction of access
//                     (checked where the transport can, see Access);
//   ResourceExhausted memory could not be allocated or registered;
//   FailedPrecondition  the local Transport has been shut down;
//   Unavailable       the peer (named in the message) died, went away, or its
//                     region no longer exists; retry after reconnecting;
//   DeadlineExceeded  the deadline passed first; the operation is still in
//                     flight and its buffer still in use;
//   Cancelled         the operation was aborted.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/tls_files.h"

namespace zeroshard::transport {

// What a peer may do to a registered region. Enforced by the inproc
// transport; UCX passes it to the memory registration, where only hardware
// transports enforce it (software-emulated RMA over tcp or shm does not).
enum class Access : uint8_t {
  kRemoteRead = 1,   // peers may Get from it
  kRemoteWrite = 2,  // peers may Put into it
  kRemoteReadWrite = 3,
};

// Everything a peer needs to access one registered region. Plain data: put
// the three fields in a protobuf as they are. `rkey` is opaque, transport-
// specific bytes; a descriptor is only meaningful to connections made to the
// LocalAddress() of the Transport that produced it.
struct RegionDescriptor {
  uint64_t address = 0;  // address of the region's first byte in the owner
  uint64_t length = 0;   // bytes
  std::string rkey;      // packed remote key
};

// A self-contained byte encoding of a descriptor (for tools and tests; a
// protobuf carries the fields directly). Decode returns InvalidArgument on
// malformed input.
std::string EncodeRegionDescriptor(const RegionDescriptor& descriptor);
absl::StatusOr<RegionDescriptor> DecodeRegionDescriptor(
    absl::string_view bytes);

// OK iff [offset, offset + length) lies within `descriptor` (with no integer
// overflow); InvalidArgument naming `what` otherwise. Transports run this
// before touching any memory.
absl::Status CheckRange(const RegionDescriptor& descriptor, uint64_t offset,
                        uint64_t length, absl::string_view what);

// Whether [offset, offset + length) lies within `region_length` bytes, with
// no integer overflow.
inline bool RangeWithin(uint64_t region_length, uint64_t offset,
                        uint64_t length) {
  return offset <= region_length && length <= region_length - offset;
}

// Whether a region registered with `granted` allows `needed`.
inline bool Allows(Access granted, Access needed) {
  return (static_cast<uint8_t>(granted) & static_cast<uint8_t>(needed)) ==
         static_cast<uint8_t>(needed);
}

// The shared state of one operation, for transport implementations: the
// transport calls Finish() once; the Completion handle waits on it.
class CompletionState {
 public:
  CompletionState() = default;
  CompletionState(const CompletionState&) = delete;
  CompletionState& operator=(const CompletionState&) = delete;
  virtual ~CompletionState() = default;

  // Records the final status and wakes waiters. Only the first call counts.
  // Must not be called with locks held that a waiter's thread might need.
  void Finish(absl::Status status);

  bool IsDone() const;
  absl::Status Wait(absl::Time deadline);

  // Idempotent; calls OnAbort() once, on the calling thread, if not done.
  void Abort();
  bool abort_requested() const;

 protected:
  // Transport hook: stop the operation soon and Finish() it (normally with
  // Cancelled) once no transport activity touches the caller's buffer any
  // more. Must not block. Default: nothing (the op finishes on its own).
  virtual void OnAbort() {}

 private:
  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool abort_requested_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// Handle to one Put, Get or Flush. Move-only.
//
// The caller's buffer belongs to the transport from the call that created the
// operation until Wait() returns a status other than DeadlineExceeded (or
// IsDone() is true); only then may it be reused or freed.
class Completion {
 public:
  // An empty handle; Wait() returns OK.
  Completion() = default;
  explicit Completion(std::shared_ptr<CompletionState> state);
  // A handle that is already done with `status` (e.g. a rejected argument).
  static Completion Ready(absl::Status status);

  Completion(Completion&&) = default;
  Completion& operator=(Completion&& other);
  Completion(const Completion&) = delete;
  Completion& operator=(const Completion&) = delete;

  // Dropping a handle whose operation is not done aborts it (see Abort()) and
  // blocks until the transport has let go of the buffer, at most
  // kDestroyWait; past that it returns and logs.
  ~Completion();
  static constexpr absl::Duration kDestroyWait = absl::Seconds(10);

  // Blocks the calling thread until the operation finishes or `deadline`
  // passes (DeadlineExceeded: still in flight, buffer still in use; the
  // caller may Wait again or Abort). Returns the operation's status once
  // done; may be called again and returns the same status.
  absl::Status Wait(absl::Time deadline);
  bool IsDone() const;

  // Non-blocking request to give up: parts not yet handed to the network are
  // never sent, and the operation finishes, normally with Cancelled (or with
  // its real status if it finished first), after which the buffer is free.
  // A transport that cannot cancel data already on the wire either closes
  // the connection (other operations on it then fail with Cancelled too) or
  // waits for that data; each transport's header says which.
  void Abort();

 private:
  void Release();
  std::shared_ptr<CompletionState> state_;
};

// Owns one memory registration (and, from AllocateRegion, the memory).
// Destroying it revokes the registration; peers' later accesses fail where
// the transport can detect it (see each transport). Memory given to
// RegisterRegion stays the caller's: it must stay valid until the Region is
// destroyed, and, because software-emulated RMA cannot tell a revoked region
// from a live one, a daemon should stop handing out the descriptor (over the
// control plane) before it frees the memory. A Region may outlive its
// Transport.
class Region {
 public:
  virtual ~Region() = default;
  virtual const RegionDescriptor& Descriptor() const = 0;
  virtual void* base() const = 0;
  virtual size_t length() const = 0;
};

// One initiator-side connection to a peer Transport. Thread-safe; operations
// from several threads interleave. May outlive its Transport (operations then
// fail with FailedPrecondition). Destroy it only after waiting on its
// operations; destruction closes the link, waiting a bounded time.
class Connection {
 public:
  virtual ~Connection() = default;

  // Copies `length` bytes from `src` into the peer region `dst` at
  // `dst_offset`. Never blocks: returns a handle at once. Range and argument
  // errors come back as an already-done handle, before any byte moves.
  // `src` is owned by the transport until the handle is done. Done means the
  // bytes are in the target's memory (remote completion), so a control
  // message sent afterwards can rely on them. length 0 is a no-op.
  //
  // Operations on one Connection take effect at the target in issue order:
  // a later Put wins over an earlier one on overlapping bytes, and a Get sees
  // every Put issued before it on the same Connection.
  virtual Completion Put(const void* src, size_t length,
                         const RegionDescriptor& dst, uint64_t dst_offset) = 0;

  // Copies `length` bytes of the peer region `src` at `src_offset` into
  // `dst`. Same rules as Put; `dst` is owned by the transport (and its
  // contents undefined) until the handle is done.
  virtual Completion Get(void* dst, size_t length, const RegionDescriptor& src,
                         uint64_t src_offset) = 0;

  // Blocks until every operation issued on this Connection before the call
  // is complete at the target, or `deadline` passes (DeadlineExceeded, with
  // nothing aborted). Unavailable if the peer is gone.
  virtual absl::Status Flush(absl::Time deadline) = 0;

  // Human-readable name of the peer, as used in error messages.
  virtual const std::string& peer_name() const = 0;
};

// For transport implementations: a Connection whose Put, Get and Flush are
// written once. Put and Get run the checks transport.h promises, in this
// order, each answering with an already-done handle before anything is
// queued: the range lies within the descriptor (CheckRange), the rkey is one
// of this backend's (CheckKey), length 0 is done at once (OK), a null buffer
// is InvalidArgument. What passes goes to Issue(). Flush queues a marker
// (IssueFlush) and waits for it; at the deadline it aborts the marker, never
// the operations before it, and returns DeadlineExceeded.
class CheckedConnection : public Connection {
 public:
  enum class Kind : uint8_t { kPut, kGet };

  // `backend` starts every error message of the checks: "<backend> put: ...".
  explicit CheckedConnection(absl::string_view backend);

  Completion Put(const void* src, size_t length, const RegionDescriptor& dst,
                 uint64_t dst_offset) final;
  Completion Get(void* dst, size_t length, const RegionDescriptor& src,
                 uint64_t src_offset) final;
  absl::Status Flush(absl::Time deadline) final;

 protected:
  // One Put or Get that passed the checks.
  struct Request {
    Kind kind;
    // src of a Put, dst of a Get (never null); owned by the transport until
    // the handle Issue() returns is done.
    char* local;
    size_t length;  // > 0
    // remote.address + offset: the first byte of the peer's memory touched.
    uint64_t remote_address;
    uint64_t offset;  // within the region
    // What CheckKey returned: a view into the caller's descriptor, valid
    // only during Issue().
    absl::string_view key;
  };

  // The bytes of `remote.rkey` that Issue() acts on (a view into it), or
  // InvalidArgument starting with `what` ("<backend> put") when the rkey is
  // not this backend's.
  virtual absl::StatusOr<absl::string_view> CheckKey(
      const RegionDescriptor& remote, absl::string_view what) const = 0;

  // Queues `request`; never blocks. A handle already done with the error
  // when it cannot be queued (e.g. FailedPrecondition after shutdown).
  virtual Completion Issue(const Request& request) = 0;

  // Queues a marker that finishes once every operation issued on this
  // Connection before it is complete at the target (or the peer is found
  // gone); never blocks. The error when it cannot be queued. Aborting the
  // marker must not touch the operations before it.
  virtual absl::StatusOr<std::shared_ptr<CompletionState>> IssueFlush() = 0;

 private:
  Completion Start(Kind kind, void* local, size_t length,
                   const RegionDescriptor& remote, uint64_t offset);

  const std::string put_what_;  // "<backend> put"
  const std::string get_what_;  // "<backend> get"
};

// The options every backend reads; each backend's own options embed them as
// `common` (below).
struct TransportOptions {
  // Label used in error messages seen by peers (default: transport, host,
  // pid and an instance number).
  std::string name;
  // Operations longer than this are moved in pieces of at most this many
  // bytes (PiecePlan, piece_plan.h): UCX posts one request per piece, grpc
  // sends one stream message per piece (at most 1 MiB), inproc copies one
  // piece at a time and looks for an Abort() between pieces. > 0.
  size_t max_piece_bytes = size_t{8} << 20;
  // Refuse to create a Transport whose enforces_remote_keys() would be false
  // (FailedPrecondition saying why), before it starts anything a peer could
  // reach. Only UCX can refuse; see enforces_remote_keys().
  bool require_enforced_remote_keys = false;
};

// transport/inproc (CreateInprocTransport).
struct InprocTransportOptions {
  TransportOptions common;
  // Executor threads that run the copies; Connections take them in turn,
  // round-robin over a Transport's Connect() calls. >= 1.
  int progress_threads = 1;
};

// transport/ucx (CreateUcxTransport).
struct UcxTransportOptions {
  TransportOptions common;
  // The UCX_TLS value, e.g. "tcp" or "posix,cma,self" (shm) or
  // "rc,ud,sm,self"; empty keeps UCX's default (or the UCX_TLS environment).
  std::string tls;
  // Progress threads, each with its own UCX worker. Connections take them in
  // turn, round-robin over a Transport's Connect() calls; LocalAddress()
  // names the first, which serves all incoming traffic. >= 1.
  int progress_threads = 1;
  // Pieces (common.max_piece_bytes each) outstanding per operation. >= 1.
  int max_pieces_in_flight = 4;
};

// transport/grpc (CreateGrpcTransport).
struct GrpcTransportOptions {
  TransportOptions common;
  // "HOST:PORT" to serve regions on; empty means "127.0.0.1:0" (loopback,
  // any port).
  std::string listen_address;
  // The host peers dial, put in LocalAddress() in place of listen_address's
  // host (behind NAT, or a Kubernetes pod's IP): a name, an IPv4 address or
  // an IPv6 address (brackets optional). Empty: listen_address's host, or,
  // when that is a wildcard (0.0.0.0, [::]), this machine's primary address
  // (PrimaryHostAddress(), transport/host_address.h).
  std::string advertise_host;
  // Mutual TLS for its server and its connections (common/tls_files.h); empty:
  // plaintext.
  TlsFiles tls;
};

// The options of every backend, for CreateTransport(name, options), which
// picks the backend by name at run time; the picked backend's
// Create...Transport() receives its own member only, never another backend's
// knobs.
struct BackendOptions {
  InprocTransportOptions inproc;
  UcxTransportOptions ucx;
  GrpcTransportOptions grpc;

  // Sets `common` of every member: the same name, piece size and key
  // requirement whichever backend is picked.
  void SetCommon(const TransportOptions& common) {
    inproc.common = common;
    ucx.common = common;
    grpc.common = common;
  }
};

// One per process side (a daemon or a trainer usually has one). Destroying it
// stops its threads and closes its links, waiting a bounded time; peers then
// see Unavailable. Regions and Connections made from it may outlive it.
class Transport {
 public:
  virtual ~Transport() = default;

  // "inproc", "ucx", ...
  virtual absl::string_view kind() const = 0;

  // Registers [base, base + length) for remote access (length > 0). May
  // block briefly (page pinning). The memory stays owned by the caller and
  // must outlive the returned Region.
  virtual absl::StatusOr<std::unique_ptr<Region>> RegisterRegion(
      void* base, size_t length, Access access) = 0;

  // Allocates `length` (> 0) zeroed bytes placed for remote access and
  // registers them; the Region owns the memory (Region::base()) and frees it
  // when destroyed. Prefer it for long-lived regions such as staging slots:
  // with shared-memory transports UCX allocates it in shared memory, which
  // peers then read and write directly, without the owner's progress thread.
  // Blocks while the memory is allocated and registered.
  virtual absl::StatusOr<std::unique_ptr<Region>> AllocateRegion(
      size_t length, Access access) = 0;

  // Bytes a peer passes to Connect() to reach this Transport. Stable for its
  // lifetime; opaque; fits in a protobuf `bytes` field.
  virtual const std::string& LocalAddress() const = 0;

  // Connects to the Transport whose LocalAddress() is `peer_address`,
  // blocking until the link is usable or `deadline` passes
  // (DeadlineExceeded). InvalidArgument for bytes that are not an address of
  // this kind of transport; Unavailable if the peer cannot be reached.
  virtual absl::StatusOr<std::unique_ptr<Connection>> Connect(
      absl::string_view peer_address, absl::Time deadline) = 0;

  // Whether a peer can reach through this Transport only the regions it
  // holds a descriptor of, with the Access each allows: checked by the
  // hardware or by the serving side's own code before any byte moves, or
  // else reachable only by peers that may read this process's memory anyway
  // (shared memory on this host, this process). False where a forged or
  // reused rkey reaches any memory of the process (UCX emulating RMA in
  // software over tcp, or serving keyless put and get messages beside RDMA).
  // Fixed for the Transport's life; never blocks.
  // Keeping keys secret in transit is another matter (grpc: TlsFiles).
  virtual bool enforces_remote_keys() const = 0;
};

// Registry of transports by name ("inproc", "ucx", "grpc"). Each
// implementation library registers itself when linked in, with a factory that
// passes its own member of BackendOptions to its Create...Transport().
using TransportFactory =
    std::function<absl::StatusOr<std::unique_ptr<Transport>>(
        const BackendOptions&)>;

// AlreadyExists if `name` is taken.
absl::Status RegisterTransportFactory(absl::string_view name,
                                      TransportFactory factory);

// NotFound naming the registered transports if `name` is not one of them;
// otherwise whatever the factory returns: InvalidArgument for options out of
// range, Unavailable when UCX cannot initialise for the requested UCX_TLS,
// FailedPrecondition when common.require_enforced_remote_keys is set and the
// backend, so configured, does not enforce them.
absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(
    absl::string_view name, const BackendOptions& options = {});

// Sorted names of the registered transports.
std::vector<std::string> RegisteredTransports();

}  // namespace zeroshard::transport
