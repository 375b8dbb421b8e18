#include "examples/activation_store.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace zeroshard::examples {
namespace {

uint64_t TensorBytes(const torch::Tensor& t) {
  return static_cast<uint64_t>(t.numel()) * t.element_size();
}

absl::Status NoCheckpoint(int layer) {
  return absl::NotFoundError(absl::StrCat("no activation checkpoint for layer ", layer));
}

// The store has no room for a checkpoint (RESOURCE_EXHAUSTED), or its
// daemon cannot make any now (UNAVAILABLE: its spill disk hangs, or it is
// gone, which the next step finds): the trainer keeps it, and the step's
// result is the same.
bool NoRoom(const absl::Status& s) {
  return absl::IsResourceExhausted(s) || absl::IsUnavailable(s);
}

}  // namespace

// ---- InMemoryActivationStore ----

absl::Status InMemoryActivationStore::BeginStep(uint64_t) { return EndStep(); }

absl::Status InMemoryActivationStore::Save(int layer, const torch::Tensor& input) {
  auto it = saved_.find(layer);
  if (it != saved_.end()) bytes_ -= TensorBytes(it->second);
  torch::Tensor t = input.detach();
  bytes_ += TensorBytes(t);
  peak_ = std::max(peak_, bytes_);
  saved_[layer] = std::move(t);
  return absl::OkStatus();
}

absl::StatusOr<torch::Tensor> InMemoryActivationStore::Load(int layer) {
  auto it = saved_.find(layer);
  if (it == saved_.end()) return NoCheckpoint(layer);
  return it->second;
}

absl::Status InMemoryActivationStore::EndStep() {
  saved_.clear();
  bytes_ = 0;
  return absl::OkStatus();
}

// ---- DaemonActivationStore ----

DaemonActivationStore::DaemonActivationStore(std::unique_ptr<ActivationSliceStore> store,
                                             Options options)
    : store_(std::move(store)), options_(options) {}

DaemonActivationStore::~DaemonActivationStore() {
  // The store reads or writes our tensors until their tickets complete;
  // each operation ends by its own deadline.
  for (const InFlight& f : offloads_) f.ticket.Wait(absl::InfiniteFuture()).IgnoreError();
  for (const auto& [l, f] : fetches_) f.ticket.Wait(absl::InfiniteFuture()).IgnoreError();
}

ActivationKey DaemonActivationStore::Key(int layer) const {
  ActivationKey k;
  k.step = step_;
  k.micro_batch = options_.micro_batch;
  k.layer = static_cast<uint32_t>(layer);
  return k;
}

void DaemonActivationStore::Hold(uint64_t bytes) {
  held_ += bytes;
  peak_ = std::max(peak_, held_);
}

absl::Status DaemonActivationStore::BeginStep(uint64_t step) {
  if (!saved_.empty() || !kept_.empty() || !refused_.empty() || !offloads_.empty() ||
      !fetches_.empty()) {
    RETURN_IF_ERROR(EndStep());
  }
  step_ = step;
  return absl::OkStatus();
}

void DaemonActivationStore::KeepRefused(int layer, torch::Tensor t, const absl::Status& why) {
  if (refusing_ == 0) {
    std::fprintf(stderr,
                 "activation checkpoints: the store refused layer %d of step %llu (%s); kept in "
                 "the trainer while it refuses them\n",
                 layer, static_cast<unsigned long long>(step_), why.ToString().c_str());
  }
  ++refusing_;
  ++refused_count_;
  refused_this_step_ = true;
  refused_.push_back({layer, std::move(t)});
}

void DaemonActivationStore::NoteRefusals() {
  if (refusing_ > 0 && !refused_this_step_) {
    std::fprintf(stderr,
                 "activation checkpoints: the store took every one of step %llu (%llu kept in "
                 "the trainer before)\n",
                 static_cast<unsigned long long>(step_), static_cast<unsigned long long>(refusing_));
    refusing_ = 0;
  }
  refused_this_step_ = false;
}
absl::Status DaemonActivationStore::RetireOffload() {
  InFlight& f = offloads_.front();
  const absl::Status s = f.ticket.Wait(Deadline());
  if (absl::IsDeadlineExceeded(s)) return s;  // still lent: keep it
  if (NoRoom(s)) {
    KeepRefused(f.layer, std::move(f.tensor), s);
    offloads_.pop_front();
    return absl::OkStatus();
  }
  held_ -= TensorBytes(f.tensor);
  offloads_.pop_front();
  return s;
}

absl::Status DaemonActivationStore::RetireDoneOffloads() {
  while (!offloads_.empty() && offloads_.front().ticket.done()) RETURN_IF_ERROR(RetireOffload());
  return absl::OkStatus();
}

absl::Status DaemonActivationStore::Save(int layer, const torch::Tensor& input) {
  if (saved_.count(layer) > 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("layer ", layer, ": a checkpoint was saved this step already"));
  }
  RETURN_IF_ERROR(RetireDoneOffloads());
  // The store reads the tensor's memory until the offload completes: keep
  // a contiguous reference to it until then.
  torch::Tensor t = input.detach().contiguous();
  Shape shape{t.sizes().vec(), t.scalar_type(), TensorBytes(t)};
  saved_[layer] = shape;
  step_bytes_ += shape.bytes;
  peak_step_ = std::max(peak_step_, step_bytes_);
  if (shape.bytes == 0) return absl::OkStatus();
  // Room for this one first: the oldest kept checkpoint goes to the store.
  while (!kept_.empty() && kept_.size() >= options_.keep_last) {
    Kept k = std::move(kept_.front());
    kept_.pop_front();
    const uint64_t bytes = TensorBytes(k.tensor);
    if (absl::Status s = Offload(k.layer, std::move(k.tensor)); !s.ok()) {
      held_ -= bytes;
      return s;
    }
  }
  if (options_.keep_last == 0) {
    RETURN_IF_ERROR(Offload(layer, std::move(t)));
    Hold(shape.bytes);
    return absl::OkStatus();
  }
  Hold(shape.bytes);
  kept_.push_back({layer, std::move(t)});
  return absl::OkStatus();
}

absl::Status DaemonActivationStore::Offload(int layer, torch::Tensor t) {
  // At most max_offloads_in_flight run behind the forward pass: past that,
  // wait for the oldest before lending another tensor.
  while (offloads_.size() >= std::max<uint32_t>(1, options_.max_offloads_in_flight)) {
    RETURN_IF_ERROR(RetireOffload());
  }
  absl::StatusOr<ActivationTicket> ticket = store_->Offload(Key(layer), t.data_ptr(), TensorBytes(t));
  if (!ticket.ok()) {
    if (!NoRoom(ticket.status())) return ticket.status();
    KeepRefused(layer, std::move(t), ticket.status());
    return absl::OkStatus();
  }
  offloads_.push_back({layer, std::move(t), *std::move(ticket)});
  return absl::OkStatus();
}

absl::Status DaemonActivationStore::StartFetch(int layer) {
  const Shape& shape = saved_.at(layer);
  torch::Tensor t = torch::empty(shape.sizes, torch::TensorOptions().dtype(shape.dtype));
  if (shape.bytes == 0) {
    fetches_[layer] = {layer, std::move(t), ActivationTicket()};
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(ActivationTicket ticket,
                   store_->StartFetch(Key(layer), t.data_ptr(), shape.bytes, AfterFetch::kFree));
  Hold(shape.bytes);
  fetches_[layer] = {layer, std::move(t), std::move(ticket)};
  return absl::OkStatus();
}

absl::Status DaemonActivationStore::FillFetches() {
  const size_t depth = std::max<uint32_t>(1, options_.prefetch_depth);
  while (fetches_.size() < depth && next_ < order_.size()) {
    const int layer = order_[next_++];
    if (saved_.count(layer) == 0 || fetches_.count(layer) > 0 || IsKept(layer)) continue;
    RETURN_IF_ERROR(StartFetch(layer));
  }
  return absl::OkStatus();
}

absl::Status DaemonActivationStore::BeginBackward(const std::vector<int>& order) {
  // The first fetches wait for the last offloads anyway (the store orders
  // them): let those tensors go before fetching copies of them.
  while (!offloads_.empty()) RETURN_IF_ERROR(RetireOffload());
  order_ = order;
  next_ = 0;
  // Past the fetches started now, tell the store what comes next: a daemon
  // reads spilled slices back into its arena ahead of their fetch. A hint:
  // its outcome does not matter.
  std::vector<ActivationKey> hint;
  size_t ahead = 0;  // fetches FillFetches starts now
  for (const int layer : order) {
    if (saved_.count(layer) == 0 || saved_.at(layer).bytes == 0 || IsKept(layer)) continue;
    if (ahead++ >= std::max<uint32_t>(1, options_.prefetch_depth)) hint.push_back(Key(layer));
  }
  if (!hint.empty()) store_->Prefetch(hint).IgnoreError();
  return FillFetches();
}

absl::StatusOr<torch::Tensor> DaemonActivationStore::Load(int layer) {
  if (saved_.count(layer) == 0) return NoCheckpoint(layer);
  held_ -= loaded_bytes_;
  loaded_bytes_ = 0;
  RETURN_IF_ERROR(RetireDoneOffloads());
  torch::Tensor t;
  if (auto k = Find(kept_, layer); k != kept_.end()) {
    t = std::move(k->tensor);  // never left the trainer
    kept_.erase(k);
  } else if (auto r = Find(refused_, layer); r != refused_.end()) {
    t = std::move(r->tensor);  // the store had no room for it
    refused_.erase(r);
  } else {
    if (fetches_.count(layer) == 0) RETURN_IF_ERROR(StartFetch(layer));  // out of order
    auto it = fetches_.find(layer);
    RETURN_IF_ERROR(it->second.ticket.Wait(Deadline()));
    t = std::move(it->second.tensor);
    fetches_.erase(it);  // freed on the store once fetched
  }
  saved_.erase(layer);
  // The caller holds it while it recomputes the layer: still counted.
  loaded_bytes_ = TensorBytes(t);
  RETURN_IF_ERROR(FillFetches());
  return t;
}

absl::Status DaemonActivationStore::Drain() {
  absl::Status first;
  while (!offloads_.empty()) {
    absl::Status s = RetireOffload();
    if (absl::IsDeadlineExceeded(s)) return s;
    if (first.ok()) first = s;
  }
  for (auto it = fetches_.begin(); it != fetches_.end();) {
    absl::Status s = it->second.ticket.Wait(Deadline());
    if (absl::IsDeadlineExceeded(s)) return s;
    if (first.ok()) first = s;
    held_ -= TensorBytes(it->second.tensor);
    it = fetches_.erase(it);
  }
  return first;
}

absl::Status DaemonActivationStore::EndStep() {
  absl::Status s = Drain();
  NoteRefusals();
  // Fetched slices were freed one by one; this frees what backward did not
  // fetch, or a free that failed, so nothing of the step outlives it.
  absl::Status f = store_->FreeStep(step_, Deadline()).status();
  if (s.ok()) s = f;
  held_ -= loaded_bytes_;
  loaded_bytes_ = 0;
  for (const Kept& k : kept_) held_ -= TensorBytes(k.tensor);
  kept_.clear();
  for (const Kept& k : refused_) held_ -= TensorBytes(k.tensor);
  refused_.clear();
  saved_.clear();
  order_.clear();
  next_ = 0;
  step_bytes_ = 0;
  return s;
}

}  // namespace zeroshard::examples
