#include "transport/grpc/grpc_transport.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/tls.h"
#include "grpcpp/grpcpp.h"
#include "transport/grpc/region_access.grpc.pb.h"
#include "transport/host_address.h"
#include "transport/piece_plan.h"
#include "transport/region_table.h"

namespace zeroshard::transport::grpc {
namespace {

// Data bytes per Put/Get message; a Connection uses min(max_piece_bytes, it).
constexpr size_t kMaxChunkBytes = size_t{1} << 20;
// Largest message either side sends or accepts: a chunk plus its fields.
constexpr int kMaxMessageBytes = static_cast<int>(kMaxChunkBytes) + 4096;
// Each RPC's own deadline: kRpcBaseTimeout plus kRpcTimeoutPerMiB per MiB.
constexpr absl::Duration kRpcBaseTimeout = absl::Seconds(60);
constexpr absl::Duration kRpcTimeoutPerMiB = absl::Seconds(1);
// How long a destroyed Transport's server lets incoming RPCs finish.
constexpr absl::Duration kServerShutdownGrace = absl::Milliseconds(500);
constexpr char kDefaultListenAddress[] = "127.0.0.1:0";
// Longer than any host name (253) plus a port; bounds what Connect parses.
constexpr size_t kMaxAddressBytes = 512;

// rkey: magic, region id, token (little-endian).
constexpr char kRkeyMagic[4] = {'Z', 'S', 'G', 'K'};
constexpr size_t kRkeySize = 4 + 8 + 8;

void AppendU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}
uint64_t ReadU64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

bool IsRkey(absl::string_view rkey) {
  return rkey.size() == kRkeySize &&
         std::memcmp(rkey.data(), kRkeyMagic, sizeof(kRkeyMagic)) == 0;
}

std::string Hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') {
    return "localhost";
  }
  return name;
}

// gRPC deadline for `deadline`; a past one becomes "now" (gRPC would read a
// time before the epoch as infinite).
gpr_timespec GprDeadline(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) {
    return gpr_inf_future(GPR_CLOCK_REALTIME);
  }
  const timespec ts = absl::ToTimespec(std::max(deadline, absl::Now()));
  gpr_timespec out;
  out.tv_sec = ts.tv_sec;
  out.tv_nsec = static_cast<int32_t>(ts.tv_nsec);
  out.clock_type = GPR_CLOCK_REALTIME;
  return out;
}

absl::Duration RpcTimeout(uint64_t bytes) {
  return kRpcBaseTimeout + kRpcTimeoutPerMiB * static_cast<int64_t>(bytes >> 20);
}

::grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return ::grpc::Status::OK;
  return ::grpc::Status(static_cast<::grpc::StatusCode>(status.code()),
                        std::string(status.message()));
}

struct HostPort {
  std::string host;  // a name, IPv4 address or bracketed IPv6 address
  int port = 0;
};

// Parses "HOST:PORT"; InvalidArgument, prefixed with `what`, otherwise.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view address,
                                       absl::string_view what) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": \"", absl::CHexEscape(address.substr(0, 64)),
                     address.size() > 64 ? "..." : "",
                     "\" is not HOST:PORT (", why, ")"));
  };
  if (address.size() > kMaxAddressBytes) return bad("too long");
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) return bad("no port");
  const absl::string_view host = address.substr(0, colon);
  const absl::string_view port = address.substr(colon + 1);
  if (port.empty() || port.size() > 5) return bad("port is not 0-65535");
  int value = 0;
  for (const char c : port) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) {
      return bad("port is not a number");
    }
    value = value * 10 + (c - '0');
  }
  if (value > 65535) return bad("port is not 0-65535");
  if (host.empty()) return bad("empty host");
  if (host.front() == '[') {
    if (host.size() < 3 || host.back() != ']') {
      return bad("unterminated IPv6 address");
    }
    for (const char c : host.substr(1, host.size() - 2)) {
      if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != ':' &&
          c != '.' && c != '%') {
        return bad("bad character in IPv6 address");
      }
    }
  } else {
    for (const char c : host) {
      if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' &&
          c != '-' && c != '_') {
        return bad("bad character in host");
      }
    }
  }
  return HostPort{std::string(host), value};
}

// ---------------------------------------------------------------------------
// Serving side.

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};

// One record (owner 0) in its Transport's RegionTable. The rkey carries the
// record's id and random token; a peer must present both.
class GrpcRegion : public Region {
 public:
  // `owned` is the memory when the region allocated it (freed after the
  // revocation in the destructor).
  GrpcRegion(std::shared_ptr<RegionTable> table,
             std::shared_ptr<RegionRecord> record,
             std::unique_ptr<char, FreeDeleter> owned = nullptr)
      : owned_(std::move(owned)),
        table_(std::move(table)),
        record_(std::move(record)) {
    descriptor_.address = reinterpret_cast<uintptr_t>(record_->base);
    descriptor_.length = record_->length;
    descriptor_.rkey.assign(kRkeyMagic, sizeof(kRkeyMagic));
    AppendU64(&descriptor_.rkey, record_->id);
    AppendU64(&descriptor_.rkey, record_->token);
  }
  ~GrpcRegion() override { table_->Revoke(*record_); }

  const RegionDescriptor& Descriptor() const override { return descriptor_; }
  void* base() const override { return record_->base; }
  size_t length() const override { return record_->length; }

 private:
  std::unique_ptr<char, FreeDeleter> owned_;
  std::shared_ptr<RegionTable> table_;
  std::shared_ptr<RegionRecord> record_;
  RegionDescriptor descriptor_;
};

// Serves RegionAccess on gRPC's synchronous server threads. Handlers copy
// between messages and region memory one chunk at a time, holding the
// region's lock (shared) only for the copy, never across network I/O.
class RegionAccessService final : public v1::RegionAccess::Service {
 public:
  RegionAccessService(std::string name, std::shared_ptr<RegionTable> regions)
      : name_(std::move(name)),
        quoted_name_(absl::StrCat("\"", name_, "\"")),
        regions_(std::move(regions)) {}

  ::grpc::Status Put(::grpc::ServerContext* context,
                     ::grpc::ServerReader<v1::PutChunk>* reader,
                     v1::PutReply* reply) override {
    return ToGrpc(ServePut(*context, *reader, *reply));
  }

  ::grpc::Status Get(::grpc::ServerContext* context,
                     const v1::GetRequest* request,
                     ::grpc::ServerWriter<v1::GetChunk>* writer) override {
    return ToGrpc(ServeGet(*request, *writer));
  }

  ::grpc::Status Ping(::grpc::ServerContext* context,
                      const v1::PingRequest* request,
                      v1::PingReply* reply) override {
    reply->set_name(name_);
    return ::grpc::Status::OK;
  }

 private:
  absl::Status RegionGone(uint64_t id) const {
    return absl::UnavailableError(absl::StrCat(
        "region ", id, " of \"", name_, "\" no longer exists"));
  }

  // The registered region `range` names, once the key, address, range and
  // access are all right.
  absl::StatusOr<std::shared_ptr<RegionRecord>> Resolve(
      const v1::RegionRange& range, Access needed) const {
    if (!IsRkey(range.rkey())) {
      return absl::InvalidArgumentError(
          absl::StrCat("rkey (", range.rkey().size(),
                       " bytes) is not a grpc transport key"));
    }
    const uint64_t id = ReadU64(range.rkey().data() + 4);
    const uint64_t token = ReadU64(range.rkey().data() + 12);
    std::shared_ptr<RegionRecord> record = regions_->Find(id);
    if (record == nullptr || record->token != token) return RegionGone(id);
    if (range.region_address() != reinterpret_cast<uintptr_t>(record->base)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "descriptor address does not match region ", id, " of \"", name_,
          "\" (stale or forged descriptor)"));
    }
    absl::Status status = CheckAccess(*record, range.offset(), range.length(),
                                      needed, quoted_name_);
    if (!status.ok()) return status;
    return record;
  }

  absl::Status ServePut(::grpc::ServerContext& context,
                        ::grpc::ServerReader<v1::PutChunk>& reader,
                        v1::PutReply& reply) const {
    v1::PutChunk chunk;
    if (!reader.Read(&chunk)) {
      return absl::CancelledError("put stream ended before its first chunk");
    }
    if (!chunk.has_target()) {
      return absl::InvalidArgumentError("first put chunk carries no target");
    }
    const v1::RegionRange target = chunk.target();
    absl::StatusOr<std::shared_ptr<RegionRecord>> resolved =
        Resolve(target, Access::kRemoteWrite);
    if (!resolved.ok()) return resolved.status();
    RegionRecord& record = **resolved;
    char* const dst = record.base + target.offset();
    PiecePlan received(target.length());
    while (true) {
      const std::string& data = chunk.data();
      const uint64_t at = received.offset();
      if (!received.Take(data.size())) {
        return absl::InvalidArgumentError(
            absl::StrCat("put stream carries more than the ", target.length(),
                         " bytes it announced"));
      }
      {
        absl::ReaderMutexLock lock(&record.mu);
        if (!record.live) return RegionGone(record.id);
        std::memcpy(dst + at, data.data(), data.size());
      }
      if (!reader.Read(&chunk)) break;
      if (chunk.has_target()) {
        return absl::InvalidArgumentError(
            "a put chunk after the first carries a target");
      }
    }
    if (context.IsCancelled()) {
      return absl::CancelledError(
          absl::StrCat("put cancelled after ", received.offset(), " of ",
                       target.length(), " bytes"));
    }
    if (!received.done()) {
      return absl::InvalidArgumentError(
          absl::StrCat("put stream ended after ", received.offset(),
                       " of the ", target.length(), " bytes it announced"));
    }
    reply.set_bytes_written(received.offset());
    return absl::OkStatus();
  }

  absl::Status ServeGet(const v1::GetRequest& request,
                        ::grpc::ServerWriter<v1::GetChunk>& writer) const {
    const v1::RegionRange& source = request.source();
    absl::StatusOr<std::shared_ptr<RegionRecord>> resolved =
        Resolve(source, Access::kRemoteRead);
    if (!resolved.ok()) return resolved.status();
    RegionRecord& record = **resolved;
    uint64_t chunk_bytes = kMaxChunkBytes;
    if (request.max_chunk_bytes() > 0) {
      chunk_bytes = std::min<uint64_t>(chunk_bytes, request.max_chunk_bytes());
    }
    const char* const src = record.base + source.offset();
    v1::GetChunk chunk;
    PiecePlan plan(source.length(), chunk_bytes);
    while (!plan.done()) {
      const PiecePlan::Piece piece = plan.Next();
      {
        absl::ReaderMutexLock lock(&record.mu);
        if (!record.live) return RegionGone(record.id);
        chunk.mutable_data()->assign(src + piece.offset, piece.length);
      }
      if (!writer.Write(chunk)) {
        return absl::CancelledError(
            absl::StrCat("get stream closed after ", piece.offset, " of ",
                         source.length(), " bytes"));
      }
    }
    return absl::OkStatus();
  }

  const std::string name_;
  const std::string quoted_name_;  // "\"<name>\"", for error messages
  const std::shared_ptr<RegionTable> regions_;
};

// ---------------------------------------------------------------------------
// Initiating side.

// One queued operation: a Put, a Get, or (kFlush) a ping that runs once
// everything queued before it is done.
class Op : public CompletionState {
 public:
  enum class Kind { kPut, kGet, kFlush };

  explicit Op(Kind kind) : kind(kind) {}

  const Kind kind;
  char* local = nullptr;  // src of a Put, dst of a Get
  size_t length = 0;
  v1::RegionRange range;

  // Claims the op for the worker and remembers the RPC's context, so that
  // Abort() can cancel it; false if it was aborted first (it is then done).
  bool Start(::grpc::ClientContext* context) {
    absl::MutexLock lock(&mu_);
    if (state_ != State::kQueued) return false;
    state_ = State::kRunning;
    context_ = context;
    return true;
  }

  // The RPC is over; Abort() no longer touches its context.
  void End() {
    absl::MutexLock lock(&mu_);
    state_ = State::kEnded;
    context_ = nullptr;
  }

 protected:
  void OnAbort() override {
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      if (state_ == State::kQueued) {
        state_ = State::kAborted;
        finish = true;
      } else if (state_ == State::kRunning) {
        context_->TryCancel();  // does not block; the worker finishes the op
      }
    }
    if (finish) {
      Finish(absl::CancelledError("grpc operation aborted before it was sent"));
    }
  }

 private:
  enum class State { kQueued, kRunning, kEnded, kAborted };
  absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kQueued;
  ::grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// The channel and worker thread of one Connection. The worker runs queued
// operations one at a time, in order, each as one blocking RPC. Shared by the
// Connection and (weakly) its Transport, which closes it when destroyed.
class ConnectionCore {
 public:
  // `stub` holds the Connection's channel.
  ConnectionCore(std::unique_ptr<v1::RegionAccess::Stub> stub,
                 std::string peer_name, std::string peer_address,
                 size_t chunk_bytes)
      : stub_(std::move(stub)),
        peer_name_(std::move(peer_name)),
        peer_address_(std::move(peer_address)),
        chunk_bytes_(chunk_bytes),
        thread_([this] { Loop(); }) {}

  ~ConnectionCore() {
    Close(absl::CancelledError(
        absl::StrCat("connection to grpc peer \"", peer_name_, "\" closed")));
  }

  const std::string& peer_name() const { return peer_name_; }

  // Queues `op` for the worker; the close status once closed.
  absl::Status Post(std::shared_ptr<Op> op) {
    absl::MutexLock lock(&mu_);
    if (closed_) return closed_status_;
    queue_.push_back(std::move(op));
    return absl::OkStatus();
  }

  // Stops taking operations: queued ones finish with `status`, a running RPC
  // is cancelled (its op finishes with `status` unless it completed), later
  // Posts return `status`. Blocks until the worker thread has exited, which
  // the cancellation makes prompt. Idempotent; the first status counts.
  void Close(absl::Status status) {
    std::deque<std::shared_ptr<Op>> dropped;
    {
      absl::MutexLock lock(&mu_);
      if (!closed_) {
        closed_ = true;
        closed_status_ = std::move(status);
        dropped.swap(queue_);
      }
      if (running_context_ != nullptr) running_context_->TryCancel();
    }
    for (auto& op : dropped) op->Finish(closed_status());
    absl::MutexLock lock(&join_mu_);
    if (thread_.joinable()) thread_.join();
  }

 private:
  absl::Status closed_status() {
    absl::MutexLock lock(&mu_);
    return closed_status_;
  }

  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return closed_ || !queue_.empty();
  }

  void Loop() {
    while (true) {
      ::grpc::ClientContext context;
      std::shared_ptr<Op> op;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &ConnectionCore::HasWork));
        if (closed_) return;  // Close() took the queue
        op = std::move(queue_.front());
        queue_.pop_front();
        running_context_ = &context;
      }
      absl::Status status;
      const bool started = op->Start(&context);
      if (started) {
        status = Execute(*op, context);
        op->End();
      }
      absl::Status closed = absl::OkStatus();
      {
        absl::MutexLock lock(&mu_);
        running_context_ = nullptr;
        if (closed_) closed = closed_status_;
      }
      if (!started) continue;  // aborted while queued: already finished
      if (!status.ok() && op->abort_requested()) {
        status = absl::CancelledError(absl::StrCat(
            "grpc operation on peer \"", peer_name_, "\" aborted"));
      } else if (!status.ok() && !closed.ok()) {
        status = closed;
      }
      op->Finish(std::move(status));
    }
  }

  absl::Status Execute(Op& op, ::grpc::ClientContext& context) {
    context.set_deadline(GprDeadline(absl::Now() + RpcTimeout(op.length)));
    switch (op.kind) {
      case Op::Kind::kPut:
        return RunPut(op, context);
      case Op::Kind::kGet:
        return RunGet(op, context);
      case Op::Kind::kFlush:
        break;
    }
    v1::PingReply reply;
    return FromRpc(stub_->Ping(&context, v1::PingRequest(), &reply), "flush");
  }

  absl::Status RunPut(Op& op, ::grpc::ClientContext& context) {
    v1::PutReply reply;
    std::unique_ptr<::grpc::ClientWriter<v1::PutChunk>> writer =
        stub_->Put(&context, &reply);
    *put_chunk_.mutable_target() = op.range;
    PiecePlan plan(op.length, chunk_bytes_);
    bool stream_ok = true;
    while (stream_ok && !plan.done()) {
      const PiecePlan::Piece piece = plan.Next();
      put_chunk_.set_data(op.local + piece.offset, piece.length);
      stream_ok = writer->Write(put_chunk_);
      put_chunk_.clear_target();
    }
    if (stream_ok) writer->WritesDone();
    return FromRpc(writer->Finish(), "put");
  }

  absl::Status RunGet(Op& op, ::grpc::ClientContext& context) {
    v1::GetRequest request;
    *request.mutable_source() = op.range;
    request.set_max_chunk_bytes(static_cast<uint32_t>(chunk_bytes_));
    std::unique_ptr<::grpc::ClientReader<v1::GetChunk>> reader =
        stub_->Get(&context, request);
    PiecePlan received(op.length);
    absl::Status broken = absl::OkStatus();
    while (reader->Read(&get_chunk_)) {
      const std::string& data = get_chunk_.data();
      const uint64_t at = received.offset();
      if (!received.Take(data.size())) {
        broken = absl::UnavailableError(absl::StrCat(
            "grpc get on peer \"", peer_name_, "\": it sent more than the ",
            op.length, " bytes asked for"));
        context.TryCancel();
        while (reader->Read(&get_chunk_)) {
        }
        break;
      }
      std::memcpy(op.local + at, data.data(), data.size());
    }
    const absl::Status status = FromRpc(reader->Finish(), "get");
    if (!broken.ok()) return broken;
    if (status.ok() && !received.done()) {
      return absl::UnavailableError(absl::StrCat(
          "grpc get on peer \"", peer_name_, "\": stream ended after ",
          received.offset(), " of ", op.length, " bytes"));
    }
    return status;
  }

  // The peer's InvalidArgument and PermissionDenied pass through; anything
  // else means the peer or the network failed: Unavailable.
  absl::Status FromRpc(const ::grpc::Status& status,
                       absl::string_view what) const {
    if (status.ok()) return absl::OkStatus();
    const std::string message =
        absl::StrCat("grpc ", what, " on peer \"", peer_name_, "\" (",
                     peer_address_, "): ", status.error_message());
    switch (status.error_code()) {
      case ::grpc::StatusCode::INVALID_ARGUMENT:
        return absl::InvalidArgumentError(message);
      case ::grpc::StatusCode::PERMISSION_DENIED:
        return absl::PermissionDeniedError(message);
      default:
        return absl::UnavailableError(absl::StrCat(
            message, " [",
            absl::StatusCodeToString(
                static_cast<absl::StatusCode>(status.error_code())),
            "]"));
    }
  }

  const std::unique_ptr<v1::RegionAccess::Stub> stub_;
  const std::string peer_name_;
  const std::string peer_address_;
  const size_t chunk_bytes_;
  // Worker thread only: messages reused from one operation to the next.
  v1::PutChunk put_chunk_;
  v1::GetChunk get_chunk_;

  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status closed_status_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Op>> queue_ ABSL_GUARDED_BY(mu_);
  ::grpc::ClientContext* running_context_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Mutex join_mu_;  // serialises joining thread_
  std::thread thread_;   // last: starts after the fields above exist
};

class GrpcConnection : public CheckedConnection {
 public:
  explicit GrpcConnection(std::shared_ptr<ConnectionCore> core)
      : CheckedConnection("grpc"), core_(std::move(core)) {}

  ~GrpcConnection() override {
    core_->Close(absl::CancelledError(absl::StrCat(
        "connection to grpc peer \"", core_->peer_name(), "\" closed")));
  }

  const std::string& peer_name() const override { return core_->peer_name(); }

 private:
  absl::StatusOr<absl::string_view> CheckKey(
      const RegionDescriptor& remote, absl::string_view what) const override {
    if (!IsRkey(remote.rkey)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": descriptor's rkey (", remote.rkey.size(),
                       " bytes) is not a grpc transport key"));
    }
    return absl::string_view(remote.rkey);
  }

  Completion Issue(const Request& request) override {
    auto op = std::make_shared<Op>(request.kind == Kind::kPut ? Op::Kind::kPut
                                                              : Op::Kind::kGet);
    op->local = request.local;
    op->length = request.length;
    op->range.set_region_address(request.remote_address - request.offset);
    op->range.set_rkey(request.key.data(), request.key.size());
    op->range.set_offset(request.offset);
    op->range.set_length(request.length);
    absl::Status status = core_->Post(op);
    if (!status.ok()) return Completion::Ready(std::move(status));
    return Completion(std::move(op));
  }

  // Sends nothing if aborted while queued (CheckedConnection::Flush aborts
  // it at the deadline); the operations before it are not touched.
  absl::StatusOr<std::shared_ptr<CompletionState>> IssueFlush() override {
    auto op = std::make_shared<Op>(Op::Kind::kFlush);
    absl::Status status = core_->Post(op);
    if (!status.ok()) return status;
    return op;
  }

  const std::shared_ptr<ConnectionCore> core_;
};

class GrpcTransport : public Transport {
 public:
  GrpcTransport(std::string name, size_t chunk_bytes, std::shared_ptr<RegionTable> regions,
                std::unique_ptr<RegionAccessService> service,
                std::unique_ptr<::grpc::Server> server, std::string address,
                std::shared_ptr<::grpc::ChannelCredentials> credentials)
      : name_(std::move(name)),
        chunk_bytes_(chunk_bytes),
        regions_(std::move(regions)),
        service_(std::move(service)),
        server_(std::move(server)),
        address_(std::move(address)),
        credentials_(std::move(credentials)) {}

  ~GrpcTransport() override {
    server_->Shutdown(GprDeadline(absl::Now() + kServerShutdownGrace));
    server_->Wait();
    std::vector<std::shared_ptr<ConnectionCore>> cores;
    {
      absl::MutexLock lock(&mu_);
      for (auto& weak : connections_) {
        if (auto core = weak.lock()) cores.push_back(std::move(core));
      }
      connections_.clear();
    }
    const absl::Status shut_down = absl::FailedPreconditionError(
        absl::StrCat("grpc transport \"", name_, "\" is shut down"));
    for (auto& core : cores) core->Close(shut_down);
  }

  absl::string_view kind() const override { return "grpc"; }

  // Checked in software by this Transport's server before any byte moves:
  // the rkey's region id and random 64-bit token, the descriptor's address,
  // the range and the region's Access (RegionAccessService::Resolve).
  bool enforces_remote_keys() const override { return true; }

  absl::StatusOr<std::unique_ptr<Region>> RegisterRegion(
      void* base, size_t length, Access access) override {
    if (base == nullptr || length == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("grpc RegisterRegion: empty region (base ",
                       absl::Hex(reinterpret_cast<uintptr_t>(base)),
                       ", length ", length, ")"));
    }
    return std::make_unique<GrpcRegion>(
        regions_,
        regions_->Add(/*owner=*/0, static_cast<char*>(base), length, access));
  }

  absl::StatusOr<std::unique_ptr<Region>> AllocateRegion(
      size_t length, Access access) override {
    constexpr size_t kAlignment = 64;
    if (length == 0) {
      return absl::InvalidArgumentError("grpc AllocateRegion: length 0");
    }
    if (length > SIZE_MAX - kAlignment) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "grpc AllocateRegion: cannot allocate ", length, " bytes"));
    }
    // aligned_alloc wants a multiple of the alignment.
    const size_t rounded = (length + kAlignment - 1) / kAlignment * kAlignment;
    std::unique_ptr<char, FreeDeleter> memory(
        static_cast<char*>(std::aligned_alloc(kAlignment, rounded)));
    if (memory == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "grpc AllocateRegion: cannot allocate ", length, " bytes"));
    }
    std::memset(memory.get(), 0, rounded);
    auto record = regions_->Add(/*owner=*/0, memory.get(), length, access);
    return std::make_unique<GrpcRegion>(regions_, std::move(record),
                                        std::move(memory));
  }

  const std::string& LocalAddress() const override { return address_; }

  absl::StatusOr<std::unique_ptr<Connection>> Connect(
      absl::string_view peer_address, absl::Time deadline) override {
    absl::StatusOr<HostPort> parsed =
        ParseHostPort(peer_address, "grpc Connect");
    if (!parsed.ok()) return parsed.status();
    const std::string address(peer_address);
    if (parsed->port == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("grpc Connect: \"", address, "\" has port 0"));
    }
    ::grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(kMaxMessageBytes);
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
    // A TCP connection of its own, not shared with other Connections.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    // Retry soon after a failed attempt (a peer that is still starting).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    std::shared_ptr<::grpc::Channel> channel =
        ::grpc::CreateCustomChannel(absl::StrCat("dns:///", address), credentials_, args);

    bool attempt_failed = false;
    while (true) {
      const grpc_connectivity_state state =
          channel->GetState(/*try_to_connect=*/true);
      if (state == GRPC_CHANNEL_READY) break;
      if (state == GRPC_CHANNEL_TRANSIENT_FAILURE) attempt_failed = true;
      if (!channel->WaitForStateChange(state, GprDeadline(deadline))) {
        if (attempt_failed) {
          return absl::UnavailableError(absl::StrCat(
              "grpc Connect: cannot reach \"", address, "\""));
        }
        return absl::DeadlineExceededError(absl::StrCat(
            "grpc Connect: \"", address, "\" not connected by the deadline"));
      }
    }

    std::unique_ptr<v1::RegionAccess::Stub> stub =
        v1::RegionAccess::NewStub(channel);
    ::grpc::ClientContext context;
    context.set_deadline(GprDeadline(deadline));
    v1::PingReply reply;
    const ::grpc::Status ping =
        stub->Ping(&context, v1::PingRequest(), &reply);
    if (ping.error_code() == ::grpc::StatusCode::DEADLINE_EXCEEDED) {
      return absl::DeadlineExceededError(absl::StrCat(
          "grpc Connect: \"", address, "\" did not answer by the deadline"));
    }
    if (!ping.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "grpc Connect: \"", address, "\" does not serve regions: ",
          ping.error_message()));
    }
    std::string peer_name = reply.name().empty() ? address : reply.name();
    auto core = std::make_shared<ConnectionCore>(
        std::move(stub), std::move(peer_name), address, chunk_bytes_);
    {
      absl::MutexLock lock(&mu_);
      connections_.erase(
          std::remove_if(connections_.begin(), connections_.end(),
                         [](const std::weak_ptr<ConnectionCore>& weak) {
                           return weak.expired();
                         }),
          connections_.end());
      connections_.push_back(core);
    }
    return std::make_unique<GrpcConnection>(std::move(core));
  }

 private:
  const std::string name_;
  const size_t chunk_bytes_;
  // Shared with the service and the Regions (which may outlive the Transport).
  const std::shared_ptr<RegionTable> regions_;
  // The service outlives the server that calls it.
  const std::unique_ptr<RegionAccessService> service_;
  const std::unique_ptr<::grpc::Server> server_;
  const std::string address_;
  // Of the Connections it makes: TLS or plaintext (GrpcTransportOptions::tls).
  const std::shared_ptr<::grpc::ChannelCredentials> credentials_;
  absl::Mutex mu_;
  // Closed when the Transport is destroyed.
  std::vector<std::weak_ptr<ConnectionCore>> connections_ ABSL_GUARDED_BY(mu_);
};

const bool kRegistered = [] {
  (void)RegisterTransportFactory("grpc", [](const BackendOptions& options) {
    return CreateGrpcTransport(options.grpc);
  });
  return true;
}();

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateGrpcTransport(
    const GrpcTransportOptions& options) {
  if (options.common.max_piece_bytes == 0) {
    return absl::InvalidArgumentError(
        "grpc transport: common.max_piece_bytes must be > 0");
  }
  const std::string listen = options.listen_address.empty()
                                 ? std::string(kDefaultListenAddress)
                                 : options.listen_address;
  absl::StatusOr<HostPort> parsed =
      ParseHostPort(listen, "grpc transport listen_address");
  if (!parsed.ok()) return parsed.status();
  // What peers dial, settled before anything starts.
  std::string host = parsed->host;
  if (!options.advertise_host.empty()) {
    absl::StatusOr<std::string> advertised =
        CanonicalHost(options.advertise_host, "grpc transport advertise_host");
    if (!advertised.ok()) return advertised.status();
    host = *std::move(advertised);
  } else if (IsWildcardHost(host)) {
    absl::StatusOr<std::string> primary = PrimaryHostAddress();
    if (!primary.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "grpc transport listen_address \"", listen,
          "\" is a wildcard, which peers cannot dial, and advertise_host is "
          "not set: ",
          primary.status().message()));
    }
    host = *std::move(primary);
  }

  static std::atomic<int> instances{0};
  std::string name = options.common.name.empty()
                         ? absl::StrCat("grpc:", Hostname(), ":", getpid(),
                                        ":", instances++)
                         : options.common.name;
  auto regions = std::make_shared<RegionTable>();
  auto service = std::make_unique<RegionAccessService>(name, regions);

  absl::StatusOr<std::shared_ptr<::grpc::ServerCredentials>> server_credentials =
      MakeServerCredentials(options.tls, "grpc transport tls.");
  if (!server_credentials.ok()) return server_credentials.status();
  absl::StatusOr<std::shared_ptr<::grpc::ChannelCredentials>> channel_credentials =
      MakeChannelCredentials(options.tls, "grpc transport tls.");
  if (!channel_credentials.ok()) return channel_credentials.status();
  int port = 0;
  ::grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, *server_credentials, &port);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  // The port is this Transport's alone: another one binding it must fail.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(service.get());
  std::unique_ptr<::grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    if (server != nullptr) server->Shutdown();
    return absl::UnavailableError(
        absl::StrCat("grpc transport \"", name, "\": cannot serve on \"",
                     listen, "\" (address in use or not local?)"));
  }
  const size_t chunk_bytes =
      std::min(options.common.max_piece_bytes, kMaxChunkBytes);
  return std::make_unique<GrpcTransport>(
      std::move(name), chunk_bytes, std::move(regions), std::move(service), std::move(server),
      absl::StrCat(host, ":", port), *std::move(channel_credentials));
}

}  // namespace zeroshard::transport::grpc
