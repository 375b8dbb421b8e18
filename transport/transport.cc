#include "transport/transport.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace zeroshard::transport {

// ---------------------------------------------------------------------------
// Descriptors.

namespace {

constexpr char kDescriptorMagic[4] = {'Z', 'S', 'R', 'D'};
constexpr size_t kDescriptorHeader = 4 + 8 + 8 + 4;
// Far above any real packed key; bounds what a malformed length can ask for.
constexpr uint32_t kMaxRkeyBytes = 1 << 20;

void PutU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}
void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}
uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}
uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

}  // namespace

std::string EncodeRegionDescriptor(const RegionDescriptor& descriptor) {
  std::string out(kDescriptorMagic, sizeof(kDescriptorMagic));
  PutU64(&out, descriptor.address);
  PutU64(&out, descriptor.length);
  PutU32(&out, static_cast<uint32_t>(descriptor.rkey.size()));
  out += descriptor.rkey;
  return out;
}

absl::StatusOr<RegionDescriptor> DecodeRegionDescriptor(
    absl::string_view bytes) {
  if (bytes.size() < kDescriptorHeader ||
      std::memcmp(bytes.data(), kDescriptorMagic, 4) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "not an encoded region descriptor (", bytes.size(), " bytes)"));
  }
  RegionDescriptor d;
  d.address = GetU64(bytes.data() + 4);
  d.length = GetU64(bytes.data() + 12);
  const uint32_t rkey_size = GetU32(bytes.data() + 20);
  if (rkey_size > kMaxRkeyBytes ||
      bytes.size() - kDescriptorHeader != rkey_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("region descriptor: rkey length ", rkey_size, " but ",
                     bytes.size() - kDescriptorHeader, " bytes follow"));
  }
  d.rkey.assign(bytes.data() + kDescriptorHeader, rkey_size);
  return d;
}

absl::Status CheckRange(const RegionDescriptor& descriptor, uint64_t offset,
                        uint64_t length, absl::string_view what) {
  if (!RangeWithin(descriptor.length, offset, length)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": bytes [", offset, ", ", offset, "+", length,
        ") lie outside the region of ", descriptor.length, " bytes"));
  }
  if (descriptor.address >
      std::numeric_limits<uint64_t>::max() - descriptor.length) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": region descriptor wraps the address space (address ",
        descriptor.address, ", length ", descriptor.length, ")"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Completion.

void CompletionState::Finish(absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (done_) return;
  status_ = std::move(status);
  done_ = true;
}

bool CompletionState::IsDone() const {
  absl::MutexLock lock(&mu_);
  return done_;
}

absl::Status CompletionState::Wait(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (!mu_.AwaitWithDeadline(absl::Condition(&done_), deadline)) {
    return absl::DeadlineExceededError(
        "transport operation still in flight at the deadline");
  }
  return status_;
}

void CompletionState::Abort() {
  {
    absl::MutexLock lock(&mu_);
    if (done_ || abort_requested_) return;
    abort_requested_ = true;
  }
  OnAbort();
}

bool CompletionState::abort_requested() const {
  absl::MutexLock lock(&mu_);
  return abort_requested_;
}

Completion::Completion(std::shared_ptr<CompletionState> state)
    : state_(std::move(state)) {}

Completion Completion::Ready(absl::Status status) {
  auto state = std::make_shared<CompletionState>();
  state->Finish(std::move(status));
  return Completion(std::move(state));
}

Completion& Completion::operator=(Completion&& other) {
  if (this != &other) {
    Release();
    state_ = std::move(other.state_);
  }
  return *this;
}

Completion::~Completion() { Release(); }

void Completion::Release() {
  if (state_ == nullptr || state_->IsDone()) {
    state_.reset();
    return;
  }
  state_->Abort();
  const absl::Status status = state_->Wait(absl::Now() + kDestroyWait);
  if (absl::IsDeadlineExceeded(status)) {
    std::fprintf(stderr,
                 "zeroshard transport: a dropped operation did not finish "
                 "within %s of being aborted; its buffer may still be in use\n",
                 absl::FormatDuration(kDestroyWait).c_str());
  }
  state_.reset();
}

absl::Status Completion::Wait(absl::Time deadline) {
  if (state_ == nullptr) return absl::OkStatus();
  return state_->Wait(deadline);
}

bool Completion::IsDone() const {
  return state_ == nullptr || state_->IsDone();
}

void Completion::Abort() {
  if (state_ != nullptr) state_->Abort();
}

// ---------------------------------------------------------------------------
// CheckedConnection.

CheckedConnection::CheckedConnection(absl::string_view backend)
    : put_what_(absl::StrCat(backend, " put")),
      get_what_(absl::StrCat(backend, " get")) {}

Completion CheckedConnection::Put(const void* src, size_t length,
                                  const RegionDescriptor& dst,
                                  uint64_t dst_offset) {
  // The transport only reads `src`; Request::local is one pointer for both
  // directions.
  return Start(Kind::kPut, const_cast<void*>(src), length, dst, dst_offset);
}

Completion CheckedConnection::Get(void* dst, size_t length,
                                  const RegionDescriptor& src,
                                  uint64_t src_offset) {
  return Start(Kind::kGet, dst, length, src, src_offset);
}

Completion CheckedConnection::Start(Kind kind, void* local, size_t length,
                                    const RegionDescriptor& remote,
                                    uint64_t offset) {
  const std::string& what = kind == Kind::kPut ? put_what_ : get_what_;
  absl::Status status = CheckRange(remote, offset, length, what);
  if (!status.ok()) return Completion::Ready(std::move(status));
  absl::StatusOr<absl::string_view> key = CheckKey(remote, what);
  if (!key.ok()) return Completion::Ready(key.status());
  if (length == 0) return Completion::Ready(absl::OkStatus());
  if (local == nullptr) {
    return Completion::Ready(
        absl::InvalidArgumentError(absl::StrCat(what, ": null buffer")));
  }
  Request request;
  request.kind = kind;
  request.local = static_cast<char*>(local);
  request.length = length;
  request.remote_address = remote.address + offset;
  request.offset = offset;
  request.key = *key;
  return Issue(request);
}

absl::Status CheckedConnection::Flush(absl::Time deadline) {
  absl::StatusOr<std::shared_ptr<CompletionState>> marker = IssueFlush();
  if (!marker.ok()) return marker.status();
  const absl::Status status = (*marker)->Wait(deadline);
  // The marker holds no buffer: dropping it waits for nothing, and the
  // operations before it go on.
  if (absl::IsDeadlineExceeded(status)) (*marker)->Abort();
  return status;
}

// ---------------------------------------------------------------------------
// Registry.

namespace {

struct Registry {
  absl::Mutex mu;
  std::map<std::string, TransportFactory> factories ABSL_GUARDED_BY(mu);
};

Registry& GetRegistry() {
  static Registry* const registry = new Registry;  // never destroyed
  return *registry;
}

}  // namespace

absl::Status RegisterTransportFactory(absl::string_view name,
                                      TransportFactory factory) {
  Registry& registry = GetRegistry();
  absl::MutexLock lock(&registry.mu);
  auto [it, inserted] =
      registry.factories.emplace(std::string(name), std::move(factory));
  if (!inserted) {
    return absl::AlreadyExistsError(
        absl::StrCat("transport \"", name, "\" is already registered"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(
    absl::string_view name, const BackendOptions& options) {
  TransportFactory factory;
  {
    Registry& registry = GetRegistry();
    absl::MutexLock lock(&registry.mu);
    auto it = registry.factories.find(std::string(name));
    if (it == registry.factories.end()) {
      std::vector<std::string> names;
      for (const auto& [n, f] : registry.factories) names.push_back(n);
      return absl::NotFoundError(absl::StrCat("no transport \"", name,
                                              "\" linked in; available: [",
                                              absl::StrJoin(names, ", "), "]"));
    }
    factory = it->second;
  }
  return factory(options);
}

std::vector<std::string> RegisteredTransports() {
  Registry& registry = GetRegistry();
  absl::MutexLock lock(&registry.mu);
  std::vector<std::string> names;
  for (const auto& [n, f] : registry.factories) names.push_back(n);
  return names;
}

}  // namespace zeroshard::transport
