#include "client/testing/fake_activation.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"

namespace zeroshard::testing {
namespace {

grpc::Status Error(grpc::StatusCode code, const std::string& message) {
  return grpc::Status(code, message);
}

}  // namespace

FakeActivation::FakeActivation(transport::Region* arena, uint64_t spill_capacity)
    : arena_(arena), spill_capacity_(spill_capacity) {}

FakeActivation::Counts FakeActivation::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

size_t FakeActivation::slices() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [k, s] : slices_) n += s.committed;
  return n;
}

uint64_t FakeActivation::bytes() const {
  absl::MutexLock lock(&mu_);
  uint64_t n = 0;
  for (const auto& [k, s] : slices_) n += s.committed ? s.bytes : 0;
  return n;
}

std::string FakeActivation::last_owner() const {
  absl::MutexLock lock(&mu_);
  return last_owner_;
}

void FakeActivation::set_corrupt_locate_crc(bool on) {
  absl::MutexLock lock(&mu_);
  corrupt_crc_ = on;
}

void FakeActivation::CorruptArenaSlices() {
  absl::MutexLock lock(&mu_);
  for (auto& [k, s] : slices_) {
    if (s.committed && s.in_arena) arena_base()[s.offset] ^= 0x5a;
  }
}

void FakeActivation::set_placements(bool on) {
  absl::MutexLock lock(&mu_);
  placements_ = on;
}

void FakeActivation::set_fail_releases(bool on) {
  absl::MutexLock lock(&mu_);
  fail_releases_ = on;
}

void FakeActivation::set_commit_delay(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  commit_delay_ = d;
}

void FakeActivation::set_reservation_lease(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  reservation_lease_ = d;
}

FakeActivation::Key FakeActivation::MakeKey(const v1::ActivationOwner& o,
                                            const v1::ActivationKey& k) {
  last_owner_ = absl::StrCat(o.job_id(), "/", o.rank(), "/", o.incarnation());
  return Key{o.job_id(), o.rank(), ActivationKeyFromProto(k)};
}

bool FakeActivation::FindGap(uint64_t bytes, uint64_t* offset) const {
  if (arena_ == nullptr) return false;
  std::vector<std::pair<uint64_t, uint64_t>> used;
  for (const auto& [k, s] : slices_) {
    if (s.in_arena) used.push_back({s.offset, s.offset + s.bytes});
  }
  std::sort(used.begin(), used.end());
  uint64_t at = 0;
  for (const auto& [b, e] : used) {
    if (b >= at + bytes) break;
    at = std::max(at, e);
  }
  if (at + bytes > arena_->length()) return false;
  *offset = at;
  return true;
}

uint64_t FakeActivation::SpillUsed() const {
  uint64_t n = 0;
  for (const auto& [k, s] : slices_) n += s.in_arena ? 0 : s.spilled.size();
  return n;
}

bool FakeActivation::Allocate(uint64_t bytes, uint64_t* offset) {
  while (!FindGap(bytes, offset)) {
    // Spill the oldest step's lowest layer: fetched last in backward. The
    // map's order is (job, rank, step, micro-batch, layer, ...).
    Slice* victim = nullptr;
    for (auto& [k, s] : slices_) {
      if (s.committed && s.in_arena && !s.pinned) {
        victim = &s;
        break;
      }
    }
    if (victim == nullptr || SpillUsed() + victim->bytes > spill_capacity_) return false;
    victim->spilled.assign(arena_base() + victim->offset, victim->bytes);
    victim->in_arena = false;
    victim->moved = true;
    ++counts_.spills;
  }
  return true;
}

bool FakeActivation::ReadBack(Slice& s) {
  if (s.in_arena) return true;
  uint64_t offset = 0;
  if (!Allocate(s.bytes, &offset)) return false;
  std::memcpy(arena_base() + offset, s.spilled.data(), s.bytes);
  s.spilled.clear();
  s.offset = offset;
  s.in_arena = true;
  ++counts_.readbacks;
  return true;
}

grpc::Status FakeActivation::Store(const Key& key, std::string data, bool* spilled) {
  Slice s;
  s.committed = true;
  s.bytes = data.size();
  s.crc = Crc32c(data.data(), data.size());
  uint64_t offset = 0;
  if (arena_ != nullptr && s.bytes <= arena_->length() && Allocate(s.bytes, &offset)) {
    std::memcpy(arena_base() + offset, data.data(), s.bytes);
    s.offset = offset;
    s.in_arena = true;
  } else {
    if (SpillUsed() + s.bytes > spill_capacity_) {
      return Error(grpc::StatusCode::RESOURCE_EXHAUSTED, "arena and spill space are full");
    }
    s.spilled = std::move(data);
    *spilled = true;
  }
  slices_[key] = std::move(s);
  return grpc::Status::OK;
}

grpc::Status FakeActivation::ReserveActivation(grpc::ServerContext*,
                                               const v1::ReserveActivationRequest* req,
                                               v1::ActivationPlacement* resp) {
  absl::MutexLock lock(&mu_);
  ++counts_.reserve;
  const Key key = MakeKey(req->owner(), req->key());
  if (arena_ == nullptr) return Error(grpc::StatusCode::FAILED_PRECONDITION, "no arena");
  if (req->bytes() < 1 || req->bytes() > arena_->length()) {
    return Error(grpc::StatusCode::INVALID_ARGUMENT, "bytes: 0 or larger than the arena");
  }
  if (slices_.count(key) > 0) return Error(grpc::StatusCode::ALREADY_EXISTS, "key exists");
  uint64_t offset = 0;
  if (!Allocate(req->bytes(), &offset)) {
    return Error(grpc::StatusCode::RESOURCE_EXHAUSTED, "arena and spill space are full");
  }
  Slice& s = slices_[key];
  s.in_arena = true;
  s.offset = offset;
  s.bytes = req->bytes();
  s.placement = ++last_placement_;
  resp->set_offset(offset);
  resp->set_bytes(s.bytes);
  if (placements_) resp->set_placement(s.placement);
  resp->set_lease_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(reservation_lease_)));
  return grpc::Status::OK;
}

grpc::Status FakeActivation::CommitActivation(grpc::ServerContext*,
                                              const v1::CommitActivationRequest* req,
                                              v1::ActivationStored* resp) {
  absl::Duration delay;
  {
    absl::MutexLock lock(&mu_);
    delay = commit_delay_;
  }
  absl::SleepFor(delay);
  absl::MutexLock lock(&mu_);
  ++counts_.commit;
  const Key key = MakeKey(req->owner(), req->key());
  auto it = slices_.find(key);
  if (it == slices_.end() || it->second.committed) {
    return Error(grpc::StatusCode::FAILED_PRECONDITION, "no reservation for the key");
  }
  Slice& s = it->second;
  // Unlike the daemon, the fake always knows (and reports) a checksum, so
  // that a client that checks fetches without being asked to is caught.
  const uint32_t crc = Crc32c(arena_base() + s.offset, s.bytes);
  if (req->has_crc32c()) {
    ++counts_.commits_with_crc;
    if (crc != req->crc32c()) {
      slices_.erase(it);
      return Error(grpc::StatusCode::DATA_LOSS, "crc32c mismatch");
    }
  }
  s.crc = crc;
  s.committed = true;
  resp->set_bytes(s.bytes);
  return grpc::Status::OK;
}

grpc::Status FakeActivation::OffloadActivation(grpc::ServerContext*,
                                               grpc::ServerReader<v1::ActivationChunk>* reader,
                                               v1::ActivationStored* resp) {
  absl::Duration delay;
  {
    absl::MutexLock lock(&mu_);
    delay = commit_delay_;
  }
  v1::ActivationChunk chunk;
  v1::ActivationOwner owner;
  v1::ActivationKey key;
  std::string data;
  uint64_t total = 0;
  bool first = true;
  while (reader->Read(&chunk)) {
    if (first) {
      owner = chunk.owner();
      key = chunk.key();
      total = chunk.total_bytes();
      first = false;
    }
    if (chunk.offset() != data.size() ||
        Crc32c(chunk.data().data(), chunk.data().size()) != chunk.crc32c()) {
      return Error(grpc::StatusCode::DATA_LOSS, "bad chunk");
    }
    data += chunk.data();
  }
  if (first || data.size() != total || total == 0) {
    return Error(grpc::StatusCode::INVALID_ARGUMENT, "size mismatch");
  }
  absl::SleepFor(delay);
  absl::MutexLock lock(&mu_);
  ++counts_.offload_stream;
  const Key k = MakeKey(owner, key);
  if (slices_.count(k) > 0) return Error(grpc::StatusCode::ALREADY_EXISTS, "key exists");
  bool spilled = false;
  grpc::Status s = Store(k, std::move(data), &spilled);
  if (!s.ok()) return s;
  resp->set_bytes(total);
  resp->set_spilled(spilled);
  return grpc::Status::OK;
}

grpc::Status FakeActivation::LocateActivation(grpc::ServerContext*,
                                              const v1::LocateActivationRequest* req,
                                              v1::ActivationPlacement* resp) {
  absl::MutexLock lock(&mu_);
  ++counts_.locate;
  auto it = slices_.find(MakeKey(req->owner(), req->key()));
  if (it == slices_.end() || !it->second.committed) {
    return Error(grpc::StatusCode::NOT_FOUND, "unknown key");
  }
  Slice& s = it->second;
  const bool was_spilled = !s.in_arena;
  if (!ReadBack(s)) return Error(grpc::StatusCode::RESOURCE_EXHAUSTED, "no room to read back");
  s.pinned = true;
  resp->set_offset(s.offset);
  resp->set_bytes(s.bytes);
  if (s.crc.has_value()) resp->set_crc32c(corrupt_crc_ ? ~*s.crc : *s.crc);
  resp->set_was_spilled(was_spilled);
  return grpc::Status::OK;
}

grpc::Status FakeActivation::FetchActivation(grpc::ServerContext*,
                                             const v1::FetchActivationRequest* req,
                                             grpc::ServerWriter<v1::ActivationChunk>* writer) {
  std::string data;
  uint64_t piece = 0;
  {
    absl::MutexLock lock(&mu_);
    ++counts_.fetch_stream;
    auto it = slices_.find(MakeKey(req->owner(), req->key()));
    if (it == slices_.end() || !it->second.committed) {
      return Error(grpc::StatusCode::NOT_FOUND, "unknown key");
    }
    const Slice& s = it->second;
    data = s.in_arena ? std::string(arena_base() + s.offset, s.bytes) : s.spilled;
    piece = req->max_chunk_bytes() != 0 ? req->max_chunk_bytes() : (1 << 20);
  }
  for (uint64_t off = 0; off < data.size(); off += piece) {
    v1::ActivationChunk c;
    if (off == 0) c.set_total_bytes(data.size());
    c.set_offset(off);
    c.set_data(data.substr(off, piece));
    c.set_crc32c(Crc32c(c.data().data(), c.data().size()));
    if (!writer->Write(c)) break;
  }
  return grpc::Status::OK;
}

grpc::Status FakeActivation::PrefetchActivations(grpc::ServerContext*,
                                                 const v1::PrefetchActivationsRequest* req,
                                                 v1::PrefetchActivationsResponse* resp) {
  absl::MutexLock lock(&mu_);
  ++counts_.prefetch;
  uint32_t started = 0;
  for (const v1::ActivationKey& k : req->keys()) {
    auto it = slices_.find(MakeKey(req->owner(), k));
    if (it == slices_.end() || !it->second.committed || it->second.in_arena) continue;
    if (!ReadBack(it->second)) break;
    ++started;
  }
  resp->set_started(started);
  return grpc::Status::OK;
}

grpc::Status FakeActivation::FreeActivations(grpc::ServerContext*,
                                             const v1::FreeActivationsRequest* req,
                                             v1::FreeActivationsResponse* resp) {
  absl::MutexLock lock(&mu_);
  ++counts_.free;
  const Key key = MakeKey(req->owner(), req->key());
  if (req->has_if_placement()) {
    ++counts_.free_in_place;
    if (fail_releases_) return Error(grpc::StatusCode::UNAVAILABLE, "releases fail");
    auto it = slices_.find(key);
    if (it == slices_.end()) return Error(grpc::StatusCode::NOT_FOUND, "unknown key");
    if (!it->second.committed) return Error(grpc::StatusCode::FAILED_PRECONDITION, "not committed");
    const Slice& s = it->second;
    if (!s.in_arena || s.moved || s.placement != req->if_placement()) {
      resp->set_moved(true);
      return grpc::Status::OK;
    }
    resp->set_freed(1);
    resp->set_bytes(s.bytes);
    slices_.erase(it);
    return grpc::Status::OK;
  }
  uint32_t freed = 0;
  uint64_t bytes = 0;
  for (auto it = slices_.begin(); it != slices_.end();) {
    const Key& k = it->first;
    const bool owner = k.job_id == key.job_id && k.rank == key.rank;
    bool match = false;
    if (!owner) {
      match = false;
    } else if (req->has_key() && req->whole_step()) {
      match = k.key.step == key.key.step;
    } else if (req->has_key()) {
      match = k == key;
    } else {
      match = true;
    }
    if (!match) {
      ++it;
      continue;
    }
    ++freed;
    bytes += it->second.bytes;
    it = slices_.erase(it);
  }
  resp->set_freed(freed);
  resp->set_bytes(bytes);
  return grpc::Status::OK;
}

}  // namespace zeroshard::testing
