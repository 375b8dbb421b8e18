#include "client/testing/fake_shard.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace zeroshard::testing {

absl::StatusOr<std::unique_ptr<FakeShard>> FakeShard::Start(const Options& options) {
  std::unique_ptr<FakeShard> fake(new FakeShard(options));
  absl::StatusOr<std::unique_ptr<transport::Transport>> t = transport::CreateTransport("inproc");
  if (!t.ok()) return t.status();
  fake->transport_ = *std::move(t);
  absl::StatusOr<std::unique_ptr<transport::Region>> staging = fake->transport_->AllocateRegion(
      options.staging_slots * options.staging_slot_bytes, transport::Access::kRemoteReadWrite);
  if (!staging.ok()) return staging.status();
  fake->staging_ = *std::move(staging);
  absl::StatusOr<std::unique_ptr<transport::Region>> master = fake->transport_->AllocateRegion(
      options.master_elements * sizeof(float), transport::Access::kRemoteRead);
  if (!master.ok()) return master.status();
  fake->master_ = *std::move(master);
  if (options.activation_arena_bytes > 0) {
    absl::StatusOr<std::unique_ptr<transport::Region>> arena = fake->transport_->AllocateRegion(
        options.activation_arena_bytes, transport::Access::kRemoteReadWrite);
    if (!arena.ok()) return arena.status();
    fake->arena_ = *std::move(arena);
  }
  fake->activation_ =
      std::make_unique<FakeActivation>(fake->arena_.get(), options.activation_spill_bytes);
  float* values = static_cast<float*>(fake->master_->base());
  for (uint64_t i = 0; i < options.master_elements; ++i) values[i] = 0.5f * static_cast<float>(i);
  {
    absl::MutexLock lock(&fake->mu_);
    fake->slots_.resize(options.staging_slots);
  }
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(fake.get());
  builder.RegisterService(fake->activation_.get());
  fake->server_ = builder.BuildAndStart();
  if (fake->server_ == nullptr || port == 0) {
    return absl::UnavailableError("FakeShard: cannot listen on 127.0.0.1:0");
  }
  fake->address_ = absl::StrCat("127.0.0.1:", port);
  return fake;
}

FakeShard::~FakeShard() {
  if (server_ != nullptr) {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    server_->Wait();
  }
}

void FakeShard::set_delay_before_read(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  delay_before_read_ = d;
}

void FakeShard::set_delay_while_reading(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  delay_while_reading_ = d;
}

void FakeShard::fail_fences(int n) {
  absl::MutexLock lock(&mu_);
  fail_fences_ = n;
}

void FakeShard::set_push_status(grpc::Status status) {
  absl::MutexLock lock(&mu_);
  push_status_ = std::move(status);
}

std::vector<FakeShard::Applied> FakeShard::applied() const {
  absl::MutexLock lock(&mu_);
  return applied_;
}

std::vector<std::string> FakeShard::events() const {
  absl::MutexLock lock(&mu_);
  return events_;
}

int FakeShard::push_memory_maps() const {
  absl::MutexLock lock(&mu_);
  return push_memory_maps_;
}

grpc::Status FakeShard::MapPushMemory(grpc::ServerContext*,
                                      const v1::MapPushMemoryRequest* request,
                                      v1::MapPushMemoryResponse* response) {
  absl::MutexLock lock(&mu_);
  ++push_memory_maps_;
  if (!options_.map_push_memory) {
    // What a daemon on another host answers: it cannot take the memory.
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "push memory: this stand-in cannot map a trainer's memory; it reads its "
                        "slots only");
  }
  absl::StatusOr<std::unique_ptr<transport::PeerMemory>> memory = transport::PeerMemory::Open(
      request->pid(), request->fd(), request->name(), request->bytes());
  if (!memory.ok()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        std::string(memory.status().message()));
  }
  push_memory_ = *std::move(memory);
  response->set_id(1);
  response->set_daemon_pid(::getpid());
  return grpc::Status::OK;
}

std::vector<FakeShard::WaitOnly> FakeShard::wait_only_gathers() const {
  absl::MutexLock lock(&mu_);
  return wait_only_gathers_;
}

int FakeShard::exchanges() const {
  absl::MutexLock lock(&mu_);
  return exchanges_;
}

void FakeShard::WaitIdle() const {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pushes_running_ == 0; };
  mu_.AwaitWithTimeout(absl::Condition(&idle), absl::Seconds(10));
}

grpc::Status FakeShard::ExchangeEndpoint(grpc::ServerContext*,
                                         const v1::ExchangeEndpointRequest* request,
                                         v1::ExchangeEndpointResponse* response) {
  if (request->transport() != v1::TRANSPORT_KIND_INPROC) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "the fake serves inproc only");
  }
  if (request->incarnation() < 1) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "incarnation: must be >= 1");
  }
  {
    absl::MutexLock lock(&mu_);
    ++exchanges_;
  }
  response->set_worker_address(transport_->LocalAddress());
  response->set_transport(v1::TRANSPORT_KIND_INPROC);
  response->set_staging_slots(options_.staging_slots);
  response->set_staging_slot_bytes(options_.staging_slot_bytes);
  response->set_read_lease_ms(options_.read_lease_ms);
  auto add = [&](v1::RegionPurpose purpose, const transport::Region& region) {
    v1::RemoteRegion* r = response->add_regions();
    r->set_purpose(purpose);
    r->set_address(region.Descriptor().address);
    r->set_length(region.Descriptor().length);
    r->set_rkey(region.Descriptor().rkey);
    return r;
  };
  add(v1::REGION_PURPOSE_GRAD_STAGING, *staging_);
  v1::RemoteRegion* master = add(v1::REGION_PURPOSE_PARAM_MASTER, *master_);
  master->mutable_range()->set_begin(0);
  master->mutable_range()->set_end(options_.master_elements);
  if (arena_ != nullptr) add(v1::REGION_PURPOSE_ACTIVATION_ARENA, *arena_);
  return grpc::Status::OK;
}

grpc::Status FakeShard::ApplyStaged(const std::vector<v1::GradientChunk>& chunks) {
  const v1::GradientChunk& c = chunks[0];
  const uint32_t slot = c.staging_slot();
  const uint64_t generation = c.staging_generation();
  std::vector<uint64_t> lengths;
  uint64_t bytes = 0;
  for (const v1::GradientChunk& k : chunks) {
    if (k.staging_slot() != slot || k.staging_generation() != generation) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "chunks name different slots");
    }
    lengths.push_back((k.range().end() - k.range().begin()) *
                      (k.dtype() == v1::DTYPE_FP32 ? 4 : 2));
    bytes += lengths.back();
  }
  // Pulled: each chunk read where it lies in the push memory, whatever
  // their bytes together.
  std::shared_ptr<const transport::PeerMemory> memory;
  if (c.push_memory() != 0) {
    absl::MutexLock lock(&mu_);
    memory = push_memory_;
    if (c.push_memory() != 1 || memory == nullptr) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no such push memory");
    }
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (chunks[i].push_memory() != 1 ||
          chunks[i].push_memory_offset() > memory->bytes().size() ||
          lengths[i] > memory->bytes().size() - chunks[i].push_memory_offset()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "a chunk lies outside the push memory");
      }
    }
    bytes = 0;  // no slot bytes
  }
  const std::string name = absl::StrCat(slot, " ", generation);
  absl::Duration before, during;
  {
    absl::MutexLock lock(&mu_);
    if (slot >= slots_.size() || bytes > options_.staging_slot_bytes || generation < 1) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "bad slot, size or generation");
    }
    events_.push_back("announce " + name);
    before = delay_before_read_;
    during = delay_while_reading_;
  }
  absl::SleepFor(before);
  {
    absl::MutexLock lock(&mu_);
    SlotState& s = slots_[slot];
    if (generation <= s.fenced || generation <= s.applied) {
      events_.push_back("refuse " + name);
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("slot ", slot, " generation ", generation,
                                       " was fenced or applied already"));
    }
    s.reading = true;
  }
  absl::SleepFor(during);
  const char* at = static_cast<const char*>(staging_->base()) + slot * options_.staging_slot_bytes;
  absl::MutexLock lock(&mu_);
  SlotState& s = slots_[slot];
  s.reading = false;
  if (!push_status_.ok()) {
    events_.push_back("refuse " + name);
    return push_status_;
  }
  s.applied = generation;
  for (size_t i = 0; i < chunks.size(); at += lengths[i], ++i) {
    const char* from =
        memory != nullptr ? memory->bytes().data() + chunks[i].push_memory_offset() : at;
    applied_.push_back({slot,
                        generation,
                        {chunks[i].range().begin(), chunks[i].range().end()},
                        std::string(from, lengths[i])});
  }
  events_.push_back("apply " + name);
  return grpc::Status::OK;
}

grpc::Status FakeShard::PushGradient(grpc::ServerContext*,
                                     grpc::ServerReader<v1::GradientChunk>* reader,
                                     v1::PushGradientResponse* response) {
  {
    absl::MutexLock lock(&mu_);
    ++pushes_running_;
  }
  std::vector<v1::GradientChunk> chunks;
  v1::GradientChunk chunk;
  while (reader->Read(&chunk)) chunks.push_back(chunk);
  grpc::Status status;
  if (chunks.empty()) {
    status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty stream");
  } else if (std::any_of(chunks.begin(), chunks.end(), [](const v1::GradientChunk& c) {
               return !c.staged() || c.incarnation() < 1;
             })) {
    status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the fake takes staged chunks only");
  } else {
    status = ApplyStaged(chunks);
  }
  if (status.ok()) {
    uint64_t elements = 0;
    for (const v1::GradientChunk& c : chunks) elements += c.range().end() - c.range().begin();
    response->set_elements(elements);
  }
  absl::MutexLock lock(&mu_);
  --pushes_running_;
  return status;
}

grpc::Status FakeShard::FenceStagingSlot(grpc::ServerContext*,
                                         const v1::FenceStagingSlotRequest* request,
                                         v1::FenceStagingSlotResponse* response) {
  absl::MutexLock lock(&mu_);
  const std::string name = absl::StrCat(request->slot(), " ", request->generation());
  if (fail_fences_ > 0) {
    --fail_fences_;
    events_.push_back("fence-failed " + name);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fence failed (injected)");
  }
  if (request->slot() >= slots_.size()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "slot out of range");
  }
  const uint32_t slot = request->slot();
  auto not_reading = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !slots_[slot].reading; };
  mu_.AwaitWithTimeout(absl::Condition(&not_reading), absl::Seconds(10));
  SlotState& s = slots_[slot];
  s.fenced = std::max(s.fenced, request->generation());
  response->set_applied_generation(s.applied);
  events_.push_back(absl::StrCat("fence ", name, " -> ", s.applied));
  return grpc::Status::OK;
}

grpc::Status FakeShard::Gather(grpc::ServerContext*, const v1::GatherRequest* request,
                               grpc::ServerWriter<v1::ParameterChunk>*) {
  if (!request->wait_only()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the fake serves wait_only gathers");
  }
  if (request->range().end() > options_.master_elements) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "range outside the parameters");
  }
  absl::MutexLock lock(&mu_);
  wait_only_gathers_.push_back({request->after_step(), request->unreported_read_bytes()});
  return grpc::Status::OK;
}

}  // namespace zeroshard::testing
