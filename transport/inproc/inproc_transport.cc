#include "transport/inproc/inproc_transport.h"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "transport/piece_plan.h"
#include "transport/region_table.h"

namespace zeroshard::transport::inproc {
namespace {

constexpr char kAddressMagic[4] = {'Z', 'S', 'I', 'A'};
constexpr char kRkeyMagic[4] = {'Z', 'S', 'I', 'K'};
constexpr size_t kRkeySize = 4 + 8 + 8;

void AppendU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}
uint64_t ReadU64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// Process-wide table of live transports and their regions (a record's owner
// is its transport's id).
class Directory {
 public:
  static Directory& Get() {
    static Directory* const directory = new Directory;  // never destroyed
    return *directory;
  }

  uint64_t AddTransport() {
    absl::MutexLock lock(&mu_);
    const uint64_t id = next_id_++;
    transports_.insert(id);
    return id;
  }

  // Revokes the transport's regions; waits for copies touching them.
  void RemoveTransport(uint64_t id) {
    {
      absl::MutexLock lock(&mu_);
      transports_.erase(id);
    }
    regions_.RevokeOwnedBy(id);
  }

  bool TransportLive(uint64_t id) {
    absl::MutexLock lock(&mu_);
    return transports_.contains(id);
  }

  RegionTable& regions() { return regions_; }

 private:
  absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_set<uint64_t> transports_ ABSL_GUARDED_BY(mu_);
  RegionTable regions_;
};

class InprocRegion : public Region {
 public:
  // `owned` is the memory when the region allocated it (freed last).
  InprocRegion(std::shared_ptr<RegionRecord> record,
               std::unique_ptr<char[]> owned = nullptr)
      : owned_(std::move(owned)), record_(std::move(record)) {
    descriptor_.address = reinterpret_cast<uintptr_t>(record_->base);
    descriptor_.length = record_->length;
    descriptor_.rkey.assign(kRkeyMagic, sizeof(kRkeyMagic));
    AppendU64(&descriptor_.rkey, record_->id);
    AppendU64(&descriptor_.rkey, record_->owner);
  }
  ~InprocRegion() override { Directory::Get().regions().Revoke(*record_); }

  const RegionDescriptor& Descriptor() const override { return descriptor_; }
  void* base() const override { return record_->base; }
  size_t length() const override { return record_->length; }

 private:
  std::unique_ptr<char[]> owned_;  // freed after ~InprocRegion revoked it
  std::shared_ptr<RegionRecord> record_;
  RegionDescriptor descriptor_;
};

// One queued operation: a copy, or (kFlush) a marker that finishes when the
// executor reaches it.
class Op : public CompletionState {
 public:
  enum class Kind { kPut, kGet, kFlush };

  Kind kind = Kind::kFlush;
  char* local = nullptr;  // src of a Put, dst of a Get
  size_t length = 0;
  size_t piece_bytes = 0;  // copied in pieces of this many bytes
  uint64_t region_id = 0;
  uint64_t remote_address = 0;  // descriptor.address + offset
  uint64_t peer = 0;
  // `inproc peer "<name>"`, how error messages name the peer.
  std::shared_ptr<const std::string> peer_label;

  // Claims the op for execution; false if it was aborted first.
  bool Start() {
    int expected = kQueued;
    return state_.compare_exchange_strong(expected, kRunning);
  }

 protected:
  void OnAbort() override {
    int expected = kQueued;
    if (state_.compare_exchange_strong(expected, kAborted)) {
      Finish(absl::CancelledError("inproc operation aborted before it ran"));
    }
  }

 private:
  static constexpr int kQueued = 0, kRunning = 1, kAborted = 2;
  std::atomic<int> state_{kQueued};
};

absl::Status PeerGone(const Op& op) {
  return absl::UnavailableError(absl::StrCat(*op.peer_label, " is gone"));
}

absl::Status Execute(Op& op) {
  Directory& directory = Directory::Get();
  if (!directory.TransportLive(op.peer)) return PeerGone(op);
  if (op.kind == Op::Kind::kFlush) return absl::OkStatus();

  std::shared_ptr<RegionRecord> record = directory.regions().Find(op.region_id);
  if (record == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        *op.peer_label, ": region ", op.region_id, " has been deregistered"));
  }
  absl::ReaderMutexLock lock(&record->mu);
  if (!record->live) {
    return absl::UnavailableError(absl::StrCat(
        *op.peer_label, ": region ", op.region_id, " has been deregistered"));
  }
  if (record->owner != op.peer) {
    return absl::InvalidArgumentError(absl::StrCat(
        "region ", op.region_id, " does not belong to ", *op.peer_label));
  }
  const uint64_t base = reinterpret_cast<uintptr_t>(record->base);
  if (op.remote_address < base) {
    return absl::InvalidArgumentError(absl::StrCat(
        "descriptor does not match region ", op.region_id, " of ",
        *op.peer_label, " (stale or forged address)"));
  }
  const uint64_t offset = op.remote_address - base;
  const bool put = op.kind == Op::Kind::kPut;
  absl::Status status =
      CheckAccess(*record, offset, op.length,
                  put ? Access::kRemoteWrite : Access::kRemoteRead,
                  *op.peer_label);
  if (!status.ok()) return status;
  char* remote = record->base + offset;
  PiecePlan plan(op.length, op.piece_bytes);
  while (!plan.done()) {
    if (plan.offset() > 0 && op.abort_requested()) {
      return absl::CancelledError(absl::StrCat(
          "inproc operation aborted after ", plan.offset(), " of ", op.length,
          " bytes"));
    }
    const PiecePlan::Piece piece = plan.Next();
    if (put) {
      std::memcpy(remote + piece.offset, op.local + piece.offset, piece.length);
    } else {
      std::memcpy(op.local + piece.offset, remote + piece.offset, piece.length);
    }
  }
  return absl::OkStatus();
}

// A thread running queued operations in FIFO order.
class Executor {
 public:
  explicit Executor(std::string owner_name)
      : owner_name_(std::move(owner_name)), thread_([this] { Loop(); }) {}

  ~Executor() { Stop(); }

  // False once stopped (the op is then the caller's to finish).
  bool Post(std::shared_ptr<Op> op) {
    absl::MutexLock lock(&mu_);
    if (stopping_) return false;
    queue_.push_back(std::move(op));
    return true;
  }

  // Finishes queued ops with FailedPrecondition and joins. Idempotent.
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    thread_.join();
  }

  absl::Status ShutDownError() const {
    return absl::FailedPreconditionError(
        absl::StrCat("inproc transport \"", owner_name_, "\" is shut down"));
  }

 private:
  void Loop() {
    while (true) {
      std::deque<std::shared_ptr<Op>> batch;
      bool stopping;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &Executor::HasWork));
        batch.swap(queue_);
        stopping = stopping_;
      }
      for (auto& op : batch) {
        if (stopping) {
          op->Finish(ShutDownError());
        } else if (op->Start()) {
          op->Finish(Execute(*op));
        }
      }
      if (stopping) return;
    }
  }

  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !queue_.empty();
  }

  const std::string owner_name_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::shared_ptr<Op>> queue_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // last: starts after the fields above exist
};

class InprocConnection : public CheckedConnection {
 public:
  InprocConnection(std::shared_ptr<Executor> executor, uint64_t peer,
                   std::string peer_name, size_t piece_bytes)
      : CheckedConnection("inproc"),
        executor_(std::move(executor)),
        peer_(peer),
        peer_name_(std::move(peer_name)),
        peer_label_(std::make_shared<const std::string>(
            absl::StrCat("inproc peer \"", peer_name_, "\""))),
        piece_bytes_(piece_bytes) {}

  const std::string& peer_name() const override { return peer_name_; }

 private:
  std::shared_ptr<Op> NewOp(Op::Kind kind) {
    auto op = std::make_shared<Op>();
    op->kind = kind;
    op->peer = peer_;
    op->peer_label = peer_label_;
    return op;
  }

  absl::StatusOr<absl::string_view> CheckKey(
      const RegionDescriptor& remote, absl::string_view what) const override {
    if (remote.rkey.size() != kRkeySize ||
        std::memcmp(remote.rkey.data(), kRkeyMagic, 4) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": descriptor's rkey (", remote.rkey.size(),
                       " bytes) is not an inproc key"));
    }
    if (ReadU64(remote.rkey.data() + 12) != peer_) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": descriptor was issued by another transport, not by \"",
          peer_name_, "\""));
    }
    return absl::string_view(remote.rkey);
  }

  Completion Issue(const Request& request) override {
    auto op = NewOp(request.kind == Kind::kPut ? Op::Kind::kPut
                                               : Op::Kind::kGet);
    op->local = request.local;
    op->length = request.length;
    op->piece_bytes = piece_bytes_;
    op->region_id = ReadU64(request.key.data() + 4);
    op->remote_address = request.remote_address;
    if (!executor_->Post(op)) {
      return Completion::Ready(executor_->ShutDownError());
    }
    return Completion(std::move(op));
  }

  absl::StatusOr<std::shared_ptr<CompletionState>> IssueFlush() override {
    auto op = NewOp(Op::Kind::kFlush);
    if (!executor_->Post(op)) return executor_->ShutDownError();
    return op;
  }

  std::shared_ptr<Executor> executor_;
  const uint64_t peer_;
  const std::string peer_name_;
  const std::shared_ptr<const std::string> peer_label_;
  const size_t piece_bytes_;
};

class InprocTransport : public Transport {
 public:
  explicit InprocTransport(const InprocTransportOptions& options)
      : piece_bytes_(options.common.max_piece_bytes) {
    static std::atomic<int> instances{0};
    name_ = options.common.name.empty()
                ? absl::StrCat("inproc:", getpid(), ":", instances++)
                : options.common.name;
    id_ = Directory::Get().AddTransport();
    address_.assign(kAddressMagic, sizeof(kAddressMagic));
    AppendU64(&address_, id_);
    address_ += name_;
    for (int i = 0; i < options.progress_threads; ++i) {
      executors_.push_back(std::make_shared<Executor>(name_));
    }
  }

  ~InprocTransport() override {
    Directory::Get().RemoveTransport(id_);
    for (auto& executor : executors_) executor->Stop();
  }

  absl::string_view kind() const override { return "inproc"; }

  // Every access is checked against the process-wide table of live regions
  // (id, owner, range, Access) before a byte moves, and only this process
  // can reach it.
  bool enforces_remote_keys() const override { return true; }

  absl::StatusOr<std::unique_ptr<Region>> RegisterRegion(
      void* base, size_t length, Access access) override {
    if (base == nullptr || length == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("inproc RegisterRegion: empty region (base ",
                       absl::Hex(reinterpret_cast<uintptr_t>(base)),
                       ", length ", length, ")"));
    }
    return std::make_unique<InprocRegion>(Directory::Get().regions().Add(
        id_, static_cast<char*>(base), length, access));
  }

  absl::StatusOr<std::unique_ptr<Region>> AllocateRegion(
      size_t length, Access access) override {
    if (length == 0) {
      return absl::InvalidArgumentError("inproc AllocateRegion: length 0");
    }
    std::unique_ptr<char[]> memory(new (std::nothrow) char[length]());
    if (memory == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "inproc AllocateRegion: cannot allocate ", length, " bytes"));
    }
    auto record =
        Directory::Get().regions().Add(id_, memory.get(), length, access);
    return std::make_unique<InprocRegion>(std::move(record), std::move(memory));
  }

  const std::string& LocalAddress() const override { return address_; }

  absl::StatusOr<std::unique_ptr<Connection>> Connect(
      absl::string_view peer_address, absl::Time deadline) override {
    if (peer_address.size() < 12 ||
        std::memcmp(peer_address.data(), kAddressMagic, 4) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("inproc Connect: not an inproc address (",
                       peer_address.size(), " bytes)"));
    }
    const uint64_t peer = ReadU64(peer_address.data() + 4);
    std::string peer_name(peer_address.substr(12));
    if (!Directory::Get().TransportLive(peer)) {
      return absl::UnavailableError(
          absl::StrCat("inproc Connect: peer \"", peer_name,
                       "\" does not exist (any more)"));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError("inproc Connect: deadline passed");
    }
    const size_t index = next_executor_.fetch_add(1) % executors_.size();
    return std::make_unique<InprocConnection>(executors_[index], peer,
                                              std::move(peer_name),
                                              piece_bytes_);
  }

 private:
  const size_t piece_bytes_;
  std::string name_;
  uint64_t id_ = 0;
  std::string address_;
  std::vector<std::shared_ptr<Executor>> executors_;
  std::atomic<size_t> next_executor_{0};
};

const bool kRegistered = [] {
  (void)RegisterTransportFactory("inproc", [](const BackendOptions& options) {
    return CreateInprocTransport(options.inproc);
  });
  return true;
}();

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateInprocTransport(
    const InprocTransportOptions& options) {
  if (options.progress_threads < 1 || options.common.max_piece_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inproc transport: progress_threads (", options.progress_threads,
        ") and common.max_piece_bytes (", options.common.max_piece_bytes,
        ") must be positive"));
  }
  return std::make_unique<InprocTransport>(options);
}

}  // namespace zeroshard::transport::inproc
