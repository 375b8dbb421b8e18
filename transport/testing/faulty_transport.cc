#include "transport/testing/faulty_transport.h"

#include <functional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace zeroshard::transport::testing {

namespace {

using Mode = FaultyTransport::Mode;

// A Put or Get issued on a kStalled connection: in flight until aborted.
class StalledOperation final : public CompletionState {
 public:
  StalledOperation(std::shared_ptr<FaultyTransport::Faults> faults, int connection)
      : faults_(std::move(faults)), connection_(connection) {}

 private:
  void OnAbort() override;

  const std::shared_ptr<FaultyTransport::Faults> faults_;
  const int connection_;
};

}  // namespace

class FaultyTransport::Faults {
 public:
  int AddConnection() {
    absl::MutexLock lock(&mu_);
    Grow(made_);
    return made_++;
  }

  void SetMode(int index, Mode mode) {
    absl::MutexLock lock(&mu_);
    Grow(index);
    modes_[index] = mode;
  }

  int connections_made() const {
    absl::MutexLock lock(&mu_);
    return made_;
  }

  int operations(int index) const {
    absl::MutexLock lock(&mu_);
    return index < static_cast<int>(operations_.size()) ? operations_[index] : 0;
  }

  Mode ModeOf(int index) const {
    absl::MutexLock lock(&mu_);
    return modes_[index];
  }

  // Counts one Put or Get on `index` and says how it behaves; a stalled
  // one is `stalled` (made under the same lock, so that an abort closing
  // the connection meanwhile finds it).
  Mode Issue(int index, const std::function<std::shared_ptr<CompletionState>()>& make_stalled,
             std::shared_ptr<CompletionState>* stalled) {
    absl::MutexLock lock(&mu_);
    ++operations_[index];
    if (modes_[index] == Mode::kStalled) {
      *stalled = make_stalled();
      stalled_[index].push_back(*stalled);
    }
    return modes_[index];
  }

  // Marks `index` kClosed and hands back the operations stalled on it, for
  // the caller to finish without the lock.
  std::vector<std::shared_ptr<CompletionState>> Close(int index) {
    absl::MutexLock lock(&mu_);
    modes_[index] = Mode::kClosed;
    std::vector<std::shared_ptr<CompletionState>> ops;
    for (const std::weak_ptr<CompletionState>& weak : stalled_[index]) {
      if (std::shared_ptr<CompletionState> op = weak.lock()) ops.push_back(std::move(op));
    }
    stalled_[index].clear();
    return ops;
  }

 private:
  void Grow(int index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (index >= static_cast<int>(modes_.size())) {
      modes_.resize(index + 1, Mode::kOpen);
      operations_.resize(index + 1, 0);
      stalled_.resize(index + 1);
    }
  }

  mutable absl::Mutex mu_;
  int made_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Mode> modes_ ABSL_GUARDED_BY(mu_);
  std::vector<int> operations_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<std::weak_ptr<CompletionState>>> stalled_ ABSL_GUARDED_BY(mu_);
};

namespace {

void StalledOperation::OnAbort() {
  const absl::Status closed = absl::CancelledError(absl::StrCat(
      "faulty transport: connection ", connection_, " closed to stop an aborted operation"));
  for (const std::shared_ptr<CompletionState>& op : faults_->Close(connection_)) op->Finish(closed);
  Finish(closed);  // already finished above unless it was dropped from the list
}

class FaultyConnection final : public Connection {
 public:
  FaultyConnection(std::unique_ptr<Connection> inner,
                   std::shared_ptr<FaultyTransport::Faults> faults, int index)
      : inner_(std::move(inner)), faults_(std::move(faults)), index_(index) {}

  Completion Put(const void* src, size_t length, const RegionDescriptor& dst,
                 uint64_t dst_offset) override {
    if (length == 0) return inner_->Put(src, length, dst, dst_offset);
    return Issue([&] { return inner_->Put(src, length, dst, dst_offset); });
  }

  Completion Get(void* dst, size_t length, const RegionDescriptor& src,
                 uint64_t src_offset) override {
    if (length == 0) return inner_->Get(dst, length, src, src_offset);
    return Issue([&] { return inner_->Get(dst, length, src, src_offset); });
  }

  absl::Status Flush(absl::Time deadline) override {
    switch (faults_->ModeOf(index_)) {
      case Mode::kOpen:
        return inner_->Flush(deadline);
      case Mode::kClosed:
        return Closed();
      case Mode::kStalled:
        absl::SleepFor(deadline - absl::Now());
        return absl::DeadlineExceededError("faulty transport: flush on a stalled connection");
    }
    return absl::InternalError("faulty transport: unknown mode");
  }

  const std::string& peer_name() const override { return inner_->peer_name(); }

 private:
  template <typename Forward>
  Completion Issue(Forward forward) {
    std::shared_ptr<CompletionState> stalled;
    auto make = [this]() -> std::shared_ptr<CompletionState> {
      return std::make_shared<StalledOperation>(faults_, index_);
    };
    switch (faults_->Issue(index_, make, &stalled)) {
      case Mode::kOpen:
        return forward();
      case Mode::kClosed:
        return Completion::Ready(Closed());
      case Mode::kStalled:
        return Completion(std::move(stalled));
    }
    return Completion::Ready(absl::InternalError("faulty transport: unknown mode"));
  }

  absl::Status Closed() const {
    return absl::CancelledError(
        absl::StrCat("faulty transport: connection ", index_, " is closed"));
  }

  const std::unique_ptr<Connection> inner_;
  const std::shared_ptr<FaultyTransport::Faults> faults_;
  const int index_;
};

}  // namespace

FaultyTransport::FaultyTransport(std::unique_ptr<Transport> inner)
    : inner_(std::move(inner)), faults_(std::make_shared<Faults>()) {}

FaultyTransport::~FaultyTransport() = default;

void FaultyTransport::SetMode(int index, Mode mode) {
  if (index >= 0) faults_->SetMode(index, mode);
}

int FaultyTransport::connections_made() const { return faults_->connections_made(); }

int FaultyTransport::operations(int index) const {
  return index < 0 ? 0 : faults_->operations(index);
}

absl::string_view FaultyTransport::kind() const { return inner_->kind(); }

absl::StatusOr<std::unique_ptr<Region>> FaultyTransport::RegisterRegion(void* base,
                                                                        size_t length,
                                                                        Access access) {
  return inner_->RegisterRegion(base, length, access);
}

absl::StatusOr<std::unique_ptr<Region>> FaultyTransport::AllocateRegion(size_t length,
                                                                        Access access) {
  return inner_->AllocateRegion(length, access);
}

const std::string& FaultyTransport::LocalAddress() const { return inner_->LocalAddress(); }

absl::StatusOr<std::unique_ptr<Connection>> FaultyTransport::Connect(
    absl::string_view peer_address, absl::Time deadline) {
  absl::StatusOr<std::unique_ptr<Connection>> inner = inner_->Connect(peer_address, deadline);
  if (!inner.ok()) return inner.status();
  return std::make_unique<FaultyConnection>(*std::move(inner), faults_,
                                            faults_->AddConnection());
}

bool FaultyTransport::enforces_remote_keys() const { return inner_->enforces_remote_keys(); }

}  // namespace zeroshard::transport::testing
