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
  uint64_t region_id = 0;
  uint64_t remote_address = 0;  // descriptor.address + offset
  uint64_t peer = 0;
  std::string peer_name;

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
  return absl::UnavailableError(
      absl::StrCat("inproc peer \"", op.peer_name, "\" is gone"));
}

absl::Status Execute(Op& op) {
  Directory& directory = Directory::Get();
  if (!directory.TransportLive(op.peer)) return PeerGone(op);
  if (op.kind == Op::Kind::kFlush) return absl::OkStatus();

  std::shared_ptr<RegionRecord> record = directory.regions().Find(op.region_id);
  if (record == nullptr) {
    return absl::UnavailableError(absl::StrCat("inproc peer \"", op.peer_name,
                                               "\": region ", op.region_id,
                                               " has been deregistered"));
  }
  absl::ReaderMutexLock lock(&record->mu);
  if (!record->live) {
    return absl::UnavailableError(absl::StrCat("inproc peer \"", op.peer_name,
                                               "\": region ", op.region_id,
                                               " has been deregistered"));
  }
  if (record->owner != op.peer) {
    return absl::InvalidArgumentError(
        absl::StrCat("region ", op.region_id,
                     " does not belong to inproc peer \"", op.peer_name, "\""));
  }
  const uint64_t base = reinterpret_cast<uintptr_t>(record->base);
  if (op.remote_address < base || op.remote_address - base > record->length ||
      op.length > record->length - (op.remote_address - base)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "descriptor does not match region ", op.region_id, " of inproc peer \"",
        op.peer_name, "\" (stale or forged address/length)"));
  }
  char* remote = record->base + (op.remote_address - base);
  if (op.kind == Op::Kind::kPut) {
    if ((static_cast<uint8_t>(record->access) &
         static_cast<uint8_t>(Access::kRemoteWrite)) == 0) {
      return absl::PermissionDeniedError(
          absl::StrCat("region ", op.region_id, " of inproc peer \"",
                       op.peer_name, "\" does not allow remote writes"));
    }
    std::memcpy(remote, op.local, op.length);
  } else {
    if ((static_cast<uint8_t>(record->access) &
         static_cast<uint8_t>(Access::kRemoteRead)) == 0) {
      return absl::PermissionDeniedError(
          absl::StrCat("region ", op.region_id, " of inproc peer \"",
                       op.peer_name, "\" does not allow remote reads"));
    }
    std::memcpy(op.local, remote, op.length);
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

class InprocConnection : public Connection {
 public:
  InprocConnection(std::shared_ptr<Executor> executor, uint64_t peer,
                   std::string peer_name)
      : executor_(std::move(executor)),
        peer_(peer),
        peer_name_(std::move(peer_name)) {}

  Completion Put(const void* src, size_t length, const RegionDescriptor& dst,
                 uint64_t dst_offset) override {
    return Start(Op::Kind::kPut, const_cast<void*>(src), length, dst,
                 dst_offset);
  }

  Completion Get(void* dst, size_t length, const RegionDescriptor& src,
                 uint64_t src_offset) override {
    return Start(Op::Kind::kGet, dst, length, src, src_offset);
  }

  absl::Status Flush(absl::Time deadline) override {
    auto op = NewOp(Op::Kind::kFlush);
    if (!executor_->Post(op)) return executor_->ShutDownError();
    Completion completion(std::move(op));
    return completion.Wait(deadline);
  }

  const std::string& peer_name() const override { return peer_name_; }

 private:
  std::shared_ptr<Op> NewOp(Op::Kind kind) {
    auto op = std::make_shared<Op>();
    op->kind = kind;
    op->peer = peer_;
    op->peer_name = peer_name_;
    return op;
  }

  Completion Start(Op::Kind kind, void* local, size_t length,
                   const RegionDescriptor& remote, uint64_t offset) {
    const char* what = kind == Op::Kind::kPut ? "inproc put" : "inproc get";
    absl::Status status = CheckRange(remote, offset, length, what);
    if (!status.ok()) return Completion::Ready(std::move(status));
    if (remote.rkey.size() != kRkeySize ||
        std::memcmp(remote.rkey.data(), kRkeyMagic, 4) != 0) {
      return Completion::Ready(absl::InvalidArgumentError(
          absl::StrCat(what, ": descriptor's rkey (", remote.rkey.size(),
                       " bytes) is not an inproc key")));
    }
    if (ReadU64(remote.rkey.data() + 12) != peer_) {
      return Completion::Ready(absl::InvalidArgumentError(absl::StrCat(
          what, ": descriptor was issued by another transport, not by \"",
          peer_name_, "\"")));
    }
    if (length == 0) return Completion::Ready(absl::OkStatus());
    if (local == nullptr) {
      return Completion::Ready(
          absl::InvalidArgumentError(absl::StrCat(what, ": null buffer")));
    }
    auto op = NewOp(kind);
    op->local = static_cast<char*>(local);
    op->length = length;
    op->region_id = ReadU64(remote.rkey.data() + 4);
    op->remote_address = remote.address + offset;
    if (!executor_->Post(op)) {
      return Completion::Ready(executor_->ShutDownError());
    }
    return Completion(std::move(op));
  }

  std::shared_ptr<Executor> executor_;
  const uint64_t peer_;
  const std::string peer_name_;
};

class InprocTransport : public Transport {
 public:
  explicit InprocTransport(const TransportOptions& options) {
    static std::atomic<int> instances{0};
    name_ = options.name.empty()
                ? absl::StrCat("inproc:", getpid(), ":", instances++)
                : options.name;
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
                                              std::move(peer_name));
  }

 private:
  std::string name_;
  uint64_t id_ = 0;
  std::string address_;
  std::vector<std::shared_ptr<Executor>> executors_;
  std::atomic<size_t> next_executor_{0};
};

const bool kRegistered = [] {
  (void)RegisterTransportFactory("inproc", &CreateInprocTransport);
  return true;
}();

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateInprocTransport(
    const TransportOptions& options) {
  if (options.progress_threads < 1) {
    return absl::InvalidArgumentError("inproc: progress_threads must be >= 1");
  }
  return std::make_unique<InprocTransport>(options);
}

}  // namespace zeroshard::transport::inproc
