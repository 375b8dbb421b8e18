// Python bindings for zeroshard::Client: the module `zeroshard._zeroshard`.
//
// Data crosses the boundary without a copy here: float32 through the buffer
// protocol (C-contiguous numpy arrays), or contiguous CPU torch tensors
// through their data_ptr (float32, and bfloat16 / float16 for the
// half-precision data of bf16 / fp16 jobs, which numpy cannot hold).
// Every call that waits on the network releases the GIL. A failed call raises
// zeroshard.Error (a RuntimeError) whose .code is the absl status code name.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/gloo_collective.h"
#ifdef ZS_WITH_NCCL
#include "client/nccl_collective.h"
#endif
#include "common/dtype.h"
#include "common/layout.h"
#include "proto/zeroshard/v1/checkpoint.pb.h"

namespace zeroshard::python {
namespace {

namespace py = pybind11;

// The module's exception type; set once at import.
PyObject* g_error_type = nullptr;

// Raises zeroshard.Error for a non-OK status. Needs the GIL.
[[noreturn]] void ThrowStatus(const absl::Status& status) {
  py::object type = py::reinterpret_borrow<py::object>(g_error_type);
  py::object error = type(std::string(status.message()));
  error.attr("code") = std::string(absl::StatusCodeToString(status.code()));
  PyErr_SetObject(g_error_type, error.ptr());
  throw py::error_already_set();
}

void Check(const absl::Status& status) {
  if (!status.ok()) ThrowStatus(status);
}

template <typename T>
T Check(absl::StatusOr<T> result) {
  if (!result.ok()) ThrowStatus(result.status());
  return *std::move(result);
}

DType ParsePrecision(const std::string& name) {
  if (name == "fp32") return DType::kFp32;
  if (name == "bf16") return DType::kBf16;
  if (name == "fp16") return DType::kFp16;
  throw py::value_error(
      absl::StrCat("precision: expected 'fp32', 'bf16' or 'fp16', got '", name, "'"));
}

// Client(...)'s defaults are a default ClientConfig's (and GlooCollective's
// options'), so that a change of a C++ default reaches Python. One differs
// on purpose: Python's precision is fp32 (the float32 buffers numpy holds),
// where JobSettings' is bf16.
constexpr DType kPythonDefaultPrecision = DType::kFp32;
// Client(collective=...): a Python-side choice only.
constexpr char kDefaultCollective[] = "gloo";

// Client(reduction=...)'s name of `mode`.
const char* ReductionName(ReductionMode mode) {
  return mode == ReductionMode::kTrainerCollective ? "trainer" : "daemon";
}

// Client(cuda_device=...)'s form of ClientConfig::cuda_device: None for -1.
py::object CudaDeviceArg(int device) {
  return device < 0 ? py::object(py::none()) : py::object(py::int_(device));
}

// The shortest decimal that reads back as `f`, as a double: 1e-3f gives
// 0.001, the literal it was written as (a plain conversion gives
// 0.0010000000474974513). Locale-independent.
double ShortestDecimal(float f) {
  for (int digits = 1; digits <= 9; ++digits) {
    const std::string text = absl::StrFormat("%.*g", digits, static_cast<double>(f));
    float back = 0;
    double value = 0;
    if (absl::SimpleAtof(text, &back) && back == f && absl::SimpleAtod(text, &value)) {
      return value;
    }
  }
  return f;
}

// zeroshard._zeroshard.DEFAULTS: the default of each Client(...) argument
// that has one and is not None, by name, as Client uses it; floats as
// ShortestDecimal gives them, so that zeroshard.torch's defaults read as the
// literals torch.optim.AdamW's do (1e-3, not 0.0010000000474974513; both
// are the same float32 once passed to Client).
py::dict ClientDefaults(const ClientConfig& c, const GlooCollective::Options& gloo) {
  py::dict d;
  d["stage"] = c.stage;
  d["precision"] = std::string(DTypeName(kPythonDefaultPrecision));
  d["lr"] = ShortestDecimal(c.optimizer.lr);
  d["betas"] =
      py::make_tuple(ShortestDecimal(c.optimizer.beta1), ShortestDecimal(c.optimizer.beta2));
  d["eps"] = ShortestDecimal(c.optimizer.eps);
  d["weight_decay"] = ShortestDecimal(c.optimizer.weight_decay);
  d["max_grad_norm"] = ShortestDecimal(c.max_grad_norm);
  d["bucket_bytes"] = c.bucket_bytes;
  d["rpc_timeout"] = absl::ToDoubleSeconds(c.rpc_timeout);
  d["step_timeout"] = absl::ToDoubleSeconds(c.step_timeout);
  d["checkpoint_wait"] = absl::ToDoubleSeconds(c.checkpoint_wait);
  d["replicas"] = c.replicas;
  d["reduction"] = ReductionName(c.reduction);
  d["collective_host"] = gloo.hostname;
  d["collective"] = kDefaultCollective;
  d["micro_batches"] = c.micro_batches;
  d["transport"] = c.transport;
  d["ucx_tls"] = c.ucx_tls;
  d["node_cache"] = c.node_cache;
  d["local_daemon"] = c.local_daemon;
  d["push_memory"] = c.push_memory;
  return d;
}

// A float32 view of `buffer` with `expected` elements (any shape), checked.
// The pointer stays valid while the caller holds `buffer`.
py::buffer_info Float32Buffer(const py::buffer& buffer, bool writable, uint64_t expected,
                              const char* what) {
  py::buffer_info info = buffer.request(writable);
  if (info.itemsize != sizeof(float) || info.format != py::format_descriptor<float>::format()) {
    throw py::type_error(absl::StrCat(what, ": expected a float32 buffer, got format '",
                                      info.format, "' with itemsize ", info.itemsize));
  }
  py::ssize_t stride = sizeof(float);
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] > 1 && info.strides[d] != stride) {
      throw py::value_error(absl::StrCat(what, ": the buffer must be C-contiguous"));
    }
    stride *= info.shape[d];
  }
  if (static_cast<uint64_t>(info.size) != expected) {
    throw py::value_error(absl::StrCat(what, ": expected ", expected, " elements, got ",
                                       info.size));
  }
  return info;
}

// The element type of a torch dtype, by its name ("torch.float32",
// "torch.bfloat16", "torch.float16"); nullopt for any other.
std::optional<DType> TorchDType(const std::string& name) {
  if (name == "torch.float32") return DType::kFp32;
  if (name == "torch.bfloat16") return DType::kBf16;
  if (name == "torch.float16") return DType::kFp16;
  return std::nullopt;
}

const char* TorchDTypeName(DType t) {
  switch (t) {
    case DType::kFp32: return "torch.float32";
    case DType::kBf16: return "torch.bfloat16";
    case DType::kFp16: return "torch.float16";
  }
  return "?";
}

// Whether `o` is a torch tensor (tensors have no buffer protocol, and
// Tensor.numpy() would make their storage unresizable and has no bfloat16).
bool IsTensor(const py::object& o) {
  return py::hasattr(o, "data_ptr") && py::hasattr(o, "is_contiguous") &&
         py::hasattr(o, "dtype");
}

struct TensorData {
  void* data = nullptr;
  DType dtype = DType::kFp32;
  MemoryKind memory = MemoryKind::kHost;  // a "cuda" tensor's is the device's
};

// The data of a contiguous CPU or CUDA tensor of `expected` elements whose dtype is
// `want`, or any of float32, bfloat16 and float16 when `want` is nullopt;
// checked (TypeError / ValueError naming `what`). The pointer stays valid
// while the caller holds `t` and nobody resizes its storage.
TensorData CheckedTensor(const py::object& t, uint64_t expected, std::optional<DType> want,
                         const char* what) {
  const std::string dtype_name = py::str(t.attr("dtype"));
  const std::optional<DType> dtype = TorchDType(dtype_name);
  if (want.has_value() ? dtype != want : !dtype.has_value()) {
    throw py::type_error(absl::StrCat(
        what, ": expected a ",
        want.has_value() ? TorchDTypeName(*want)
                         : "torch.float32, torch.bfloat16 or torch.float16",
        " tensor, got ", dtype_name));
  }
  const std::string device = py::str(t.attr("device").attr("type"));
  if (device != "cpu" && device != "cuda") {
    throw py::type_error(
        absl::StrCat(what, ": expected a CPU or CUDA tensor, got one on ", device));
  }
  const MemoryKind memory = device == "cuda" ? MemoryKind::kCudaDevice : MemoryKind::kHost;
  if (!t.attr("is_contiguous")().cast<bool>()) {
    throw py::value_error(absl::StrCat(what, ": the tensor must be contiguous"));
  }
  const uint64_t numel = t.attr("numel")().cast<uint64_t>();
  if (numel != expected) {
    throw py::value_error(absl::StrCat(what, ": expected ", expected, " elements, got ", numel));
  }
  const uint64_t esize = DTypeSize(*dtype);
  const uint64_t offset = t.attr("storage_offset")().cast<uint64_t>();
  const py::object storage = py::hasattr(t, "untyped_storage") ? t.attr("untyped_storage")()
                                                               : t.attr("storage")();
  const uint64_t storage_bytes = storage.attr("nbytes")().cast<uint64_t>();
  if (storage_bytes < (offset + numel) * esize) {
    throw py::value_error(absl::StrCat(what, ": the tensor's storage holds ",
                                       storage_bytes / esize, " elements, too few for ",
                                       offset + numel, " (freed?)"));
  }
  return {reinterpret_cast<void*>(t.attr("data_ptr")().cast<uintptr_t>()), *dtype, memory};
}

// For a CUDA tensor: waits for the work queued on the tensor's device's
// current stream, so the client's copies (on a stream of their own) see the
// tensor's final bytes and overwrite nothing still being read.
void SyncCurrentStream(const py::object& t) {
  py::module_::import("torch")
      .attr("cuda")
      .attr("current_stream")(t.attr("device"))
      .attr("synchronize")();
}

// A writable destination of `expected` elements of `dtype`: a contiguous CPU
// tensor of that dtype, or (float32 only) a buffer, as Float32Buffer; `keep`
// then holds its view. The pointer stays valid while the caller holds `out`
// and nobody resizes it.
TensorData WritableOut(const py::object& out, uint64_t expected, DType dtype, const char* what,
                       py::buffer_info* keep) {
  if (IsTensor(out)) return CheckedTensor(out, expected, dtype, what);
  if (dtype != DType::kFp32) {
    throw py::type_error(absl::StrCat(what, ": a ", DTypeName(dtype), " destination must be a ",
                                      TorchDTypeName(dtype), " tensor"));
  }
  if (!py::isinstance<py::buffer>(out)) {
    throw py::type_error(absl::StrCat(what, ": expected a float32 buffer or tensor"));
  }
  *keep = Float32Buffer(out.cast<py::buffer>(), true, expected, what);
  return {keep->ptr, DType::kFp32, MemoryKind::kHost};
}

// A layout from a list of tuples (name, shape, layer[, group[, frozen[,
// aliases]]]).
Layout MakeLayout(const py::list& tensors, uint64_t alignment) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const py::tuple t = tensors[i].cast<py::tuple>();
    if (t.size() < 3 || t.size() > 6) {
      throw py::value_error(absl::StrCat("tensors[", i, "]: expected (name, shape, layer[, group[, ",
                                         "frozen[, aliases]]]), got ", t.size(), " fields"));
    }
    TensorSpec spec;
    spec.name = t[0].cast<std::string>();
    spec.shape = t[1].cast<std::vector<int64_t>>();
    spec.layer = t[2].cast<uint32_t>();
    if (t.size() > 3) spec.group = t[3].cast<uint32_t>();
    if (t.size() > 4) spec.frozen = t[4].cast<bool>();
    if (t.size() > 5) spec.aliases = t[5].cast<std::vector<std::string>>();
    specs.push_back(std::move(spec));
  }
  return Check(Layout::Create(std::move(specs), alignment));
}

// Parameter groups from a list of dicts with keys lr, betas, eps and
// weight_decay (each optional: the ClientConfig default otherwise).
std::vector<ParamGroupSettings> ParseParamGroups(const py::object& groups) {
  std::vector<ParamGroupSettings> out;
  for (const py::handle& item : groups) {
    const py::dict d = item.cast<py::dict>();
    ParamGroupSettings g;
    for (const auto& [key, value] : d) {
      const std::string k = key.cast<std::string>();
      if (k == "lr") {
        g.lr = value.cast<float>();
      } else if (k == "betas") {
        const auto betas = value.cast<std::pair<float, float>>();
        g.beta1 = betas.first;
        g.beta2 = betas.second;
      } else if (k == "eps") {
        g.eps = value.cast<float>();
      } else if (k == "weight_decay") {
        g.weight_decay = value.cast<float>();
      } else {
        throw py::value_error(absl::StrCat("param_groups[", out.size(), "]: unknown key '", k,
                                           "' (lr, betas, eps, weight_decay)"));
      }
    }
    out.push_back(g);
  }
  return out;
}

// Client(loss_scale=...): None (JobSettings' default: a static scale of 1),
// a number (a static scale), or a dict of torch.cuda.amp.GradScaler's
// arguments (init_scale, growth_factor, backoff_factor, growth_interval; each
// optional, with GradScaler's default) for dynamic scaling.
LossScaleSettings ParseLossScale(const py::object& value) {
  LossScaleSettings s;
  if (value.is_none()) return s;
  if (py::isinstance<py::bool_>(value)) {
    throw py::type_error("loss_scale: expected None, a number or a dict, got a bool");
  }
  if (py::isinstance<py::float_>(value) || py::isinstance<py::int_>(value)) {
    s.dynamic = false;
    s.initial_scale = value.cast<float>();
    return s;
  }
  if (!py::isinstance<py::dict>(value)) {
    throw py::type_error(absl::StrCat("loss_scale: expected None, a number or a dict, got ",
                                      py::str(value.get_type().attr("__name__")).cast<std::string>()));
  }
  // torch.cuda.amp.GradScaler's defaults.
  s.dynamic = true;
  s.initial_scale = 65536.0f;
  s.growth_factor = 2.0f;
  s.backoff_factor = 0.5f;
  s.growth_interval = 2000;
  for (const auto& [key, item] : value.cast<py::dict>()) {
    const std::string k = key.cast<std::string>();
    if (k == "init_scale") {
      s.initial_scale = item.cast<float>();
    } else if (k == "growth_factor") {
      s.growth_factor = item.cast<float>();
    } else if (k == "backoff_factor") {
      s.backoff_factor = item.cast<float>();
    } else if (k == "growth_interval") {
      const int64_t n = item.cast<int64_t>();
      if (n < 1 || n > std::numeric_limits<uint32_t>::max()) {
        throw py::value_error(
            absl::StrCat("loss_scale['growth_interval']: must be in 1..2**32-1, got ", n));
      }
      s.growth_interval = static_cast<uint32_t>(n);
    } else {
      throw py::value_error(absl::StrCat(
          "loss_scale: unknown key '", k,
          "' (init_scale, growth_factor, backoff_factor, growth_interval)"));
    }
  }
  return s;
}

// "master", "exp_avg", "exp_avg_sq".
v1::StateArray ParseStateArray(const std::string& name) {
  if (name == "master") return v1::STATE_ARRAY_MASTER;
  if (name == "exp_avg") return v1::STATE_ARRAY_EXP_AVG;
  if (name == "exp_avg_sq") return v1::STATE_ARRAY_EXP_AVG_SQ;
  throw py::value_error(
      absl::StrCat("array: expected 'master', 'exp_avg' or 'exp_avg_sq', got '", name, "'"));
}

py::dict TrafficDict(const TrafficBytes& b) {
  py::dict d;
  d["push"] = b.push;
  d["gather"] = b.gather;
  d["init"] = b.init;
  d["collective_sent"] = b.collective_sent;  // with the other ranks (reduction='trainer')
  d["collective_received"] = b.collective_received;
  return d;
}

// ---- Activation checkpoints (client/activation_store.h) ----

// The memory of a CPU tensor of any dtype whose elements are dense and do not
// overlap, in whatever order its strides give (contiguous, transposed,
// permuted): `bytes` bytes from `data`, which a tensor made with
// torch.empty_strided of the same size, stride and dtype holds the same way.
// Checked (TypeError / ValueError naming `what`); valid while the caller
// holds `t`.
std::pair<void*, uint64_t> DenseTensorBytes(const py::object& t, const char* what) {
  if (!IsTensor(t)) throw py::type_error(absl::StrCat(what, ": expected a torch tensor"));
  const std::string device = py::str(t.attr("device").attr("type"));
  if (device != "cpu") {
    throw py::type_error(absl::StrCat(what, ": expected a CPU tensor, got one on ", device));
  }
  const std::vector<int64_t> sizes = t.attr("size")().cast<std::vector<int64_t>>();
  const std::vector<int64_t> strides = t.attr("stride")().cast<std::vector<int64_t>>();
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims longer than 1
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] > 1) dims.emplace_back(strides[d], sizes[d]);
  }
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) {
      throw py::value_error(absl::StrCat(
          what, ": the tensor's elements must be dense and not overlap (a contiguous or "
                "permuted tensor), got size ",
          py::str(t.attr("size")()).cast<std::string>(), " stride ",
          py::str(t.attr("stride")()).cast<std::string>()));
    }
    expected *= size;
  }
  const uint64_t numel = t.attr("numel")().cast<uint64_t>();
  const uint64_t esize = t.attr("element_size")().cast<uint64_t>();
  const uint64_t offset = t.attr("storage_offset")().cast<uint64_t>();
  const py::object storage = py::hasattr(t, "untyped_storage") ? t.attr("untyped_storage")()
                                                               : t.attr("storage")();
  const uint64_t storage_bytes = storage.attr("nbytes")().cast<uint64_t>();
  if (storage_bytes < (offset + numel) * esize) {
    throw py::value_error(absl::StrCat(what, ": the tensor's storage holds ", storage_bytes,
                                       " bytes, too few for its elements (freed?)"));
  }
  return {reinterpret_cast<void*>(t.attr("data_ptr")().cast<uintptr_t>()), numel * esize};
}

ActivationKey MakeActivationKey(uint64_t step, uint32_t micro_batch, uint32_t layer) {
  ActivationKey k;
  k.step = step;
  k.micro_batch = micro_batch;
  k.layer = layer;
  return k;
}

absl::Time DeadlineIn(std::optional<double> seconds) {
  return seconds.has_value() ? absl::Now() + absl::Seconds(*seconds) : absl::InfiniteFuture();
}

// An asynchronous store operation: ActivationTicket.
class PyActivationTicket {
 public:
  explicit PyActivationTicket(ActivationTicket ticket) : ticket_(std::move(ticket)) {}
  bool done() const { return ticket_.done(); }
  void Wait(std::optional<double> timeout) const {
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = ticket_.Wait(DeadlineIn(timeout));
    }
    Check(status);
  }

 private:
  ActivationTicket ticket_;
};

// Client.open_activation_store's: a DaemonSliceStore. It holds the tensors
// it reads or writes until their operations end (so the caller may drop
// them), and the Python client (keep_alive) as long as it lives.
class PyActivationStore {
 public:
  explicit PyActivationStore(std::unique_ptr<DaemonSliceStore> store)
      : store_(std::move(store)) {}
  ~PyActivationStore() { Close(); }

  // Waits for every operation in flight, then drops the store (the slices
  // stay on the daemon until freed or the job ends).
  void Close() {
    if (store_ == nullptr) return;
    {
      py::gil_scoped_release release;
      store_.reset();
    }
    lent_.clear();
  }

  std::string Name() const { return Store().name(); }

  PyActivationTicket Offload(uint64_t step, uint32_t layer, const py::object& tensor,
                             uint32_t micro_batch) {
    const auto [data, bytes] = DenseTensorBytes(tensor, "tensor");
    Sweep();
    absl::StatusOr<ActivationTicket> ticket;
    {
      py::gil_scoped_release release;
      ticket = Store().Offload(MakeActivationKey(step, micro_batch, layer), data, bytes);
    }
    return Lend(Check(std::move(ticket)), tensor);
  }

  PyActivationTicket StartFetch(uint64_t step, uint32_t layer, const py::object& out,
                                uint32_t micro_batch, bool free) {
    const auto [data, bytes] = DenseTensorBytes(out, "out");
    Sweep();
    absl::StatusOr<ActivationTicket> ticket;
    {
      py::gil_scoped_release release;
      ticket = Store().StartFetch(MakeActivationKey(step, micro_batch, layer), data, bytes,
                                  free ? AfterFetch::kFree : AfterFetch::kKeep);
    }
    return Lend(Check(std::move(ticket)), out);
  }

  PyActivationTicket Prefetch(const std::vector<std::tuple<uint64_t, uint32_t, uint32_t>>& keys) {
    std::vector<ActivationKey> k;
    for (const auto& [step, micro_batch, layer] : keys) {
      k.push_back(MakeActivationKey(step, micro_batch, layer));
    }
    absl::StatusOr<ActivationTicket> ticket;
    {
      py::gil_scoped_release release;
      ticket = Store().Prefetch(k);
    }
    return PyActivationTicket(Check(std::move(ticket)));
  }

  uint64_t Free(uint64_t step, uint32_t layer, uint32_t micro_batch,
                std::optional<double> timeout) {
    absl::StatusOr<uint64_t> freed;
    {
      py::gil_scoped_release release;
      freed = Store().Free(MakeActivationKey(step, micro_batch, layer), DeadlineIn(timeout));
    }
    return Check(std::move(freed));
  }

  uint64_t FreeStep(uint64_t step, std::optional<double> timeout) {
    absl::StatusOr<uint64_t> freed;
    {
      py::gil_scoped_release release;
      freed = Store().FreeStep(step, DeadlineIn(timeout));
    }
    return Check(std::move(freed));
  }

  py::dict Stats() const {
    const SliceStoreStats s = Store().Stats();
    py::dict d;
    d["stored_bytes"] = s.stored_bytes;
    d["peak_stored_bytes"] = s.peak_stored_bytes;
    d["trainer_bytes"] = s.trainer_bytes;
    d["peak_trainer_bytes"] = s.peak_trainer_bytes;
    d["offloads"] = s.offloads;
    d["fetches"] = s.fetches;
    d["offload_bytes"] = s.offload_bytes;
    d["fetch_bytes"] = s.fetch_bytes;
    d["failures"] = s.failures;
    d["spilled_offloads"] = s.spilled_offloads;
    d["spilled_fetches"] = s.spilled_fetches;
    d["streamed"] = s.streamed;
    return d;
  }

 private:
  DaemonSliceStore& Store() const {
    if (store_ == nullptr) {
      ThrowStatus(absl::FailedPreconditionError("activation store: closed"));
    }
    return *store_;
  }
  // Keeps `tensor` until `ticket` completes.
  PyActivationTicket Lend(ActivationTicket ticket, const py::object& tensor) {
    if (!ticket.done()) lent_.emplace_back(ticket, tensor);
    return PyActivationTicket(std::move(ticket));
  }
  // Drops the tensors of completed operations.
  void Sweep() {
    lent_.erase(std::remove_if(lent_.begin(), lent_.end(),
                               [](const auto& l) { return l.first.done(); }),
                lent_.end());
  }

  std::unique_ptr<DaemonSliceStore> store_;
  // Tensors lent to operations in flight; touched with the GIL held.
  std::vector<std::pair<ActivationTicket, py::object>> lent_;
};

// Gradient memory a daemon on the same host reads in place
// (Client::AllocatePushMemory): a writable buffer of float32 for
// torch.frombuffer, whose tensors keep this object, and so the memory, alive.
class PyPushMemory {
 public:
  explicit PyPushMemory(std::shared_ptr<transport::PushMemory> memory)
      : memory_(std::move(memory)) {}
  py::buffer_info Buffer() const {
    return py::buffer_info(memory_->data(), sizeof(float), py::format_descriptor<float>::format(),
                           static_cast<py::ssize_t>(memory_->size() / sizeof(float)));
  }
  size_t nbytes() const { return memory_->size(); }

 private:
  const std::shared_ptr<transport::PushMemory> memory_;
};

// Owns the C++ client. Like the client, every method except push_gradients,
// memory_report and traffic_report must be called from one thread at a time.
class PyClient {
 public:
  PyClient(std::vector<std::string> daemons, std::string job_id, uint32_t rank, uint32_t world_size,
           uint32_t stage, const std::string& precision, float lr, std::pair<float, float> betas,
           float eps, float weight_decay, float max_grad_norm, uint64_t bucket_bytes,
           double rpc_timeout, double step_timeout, std::optional<std::string> resume,
           std::optional<std::string> token, std::optional<std::string> tls_cert,
           std::optional<std::string> tls_key, std::optional<std::string> tls_ca, uint32_t replicas,
           const std::string& reduction, std::optional<std::string> collective_dir,
           const std::string& collective_host, std::optional<int> cuda_device,
           const std::string& collective_kind, const py::object& param_groups,
           uint32_t micro_batches, bool insecure, const std::string& transport,
           const std::string& ucx_tls, const py::object& loss_scale, bool node_cache,
           int local_daemon, double checkpoint_wait, bool push_memory) {
    ClientConfig c;
    c.push_memory = push_memory;
    c.node_cache = node_cache;      // ValidateConfig (in Create) refuses it with replicas 2
    c.local_daemon = local_daemon;  // -1: found by Create (client/local_daemon.h)
    c.loss_scale = ParseLossScale(loss_scale);  // ValidateConfig (in Create) checks the values
    c.transport = transport;  // ValidateConfig (in Create) names a bad one
    c.ucx_tls = ucx_tls;
    c.micro_batches = micro_batches;
    if (!param_groups.is_none()) c.param_groups = ParseParamGroups(param_groups);
    c.cuda_device = cuda_device.value_or(-1);
    std::unique_ptr<Collective> collective;
    if (collective_kind != "gloo" && collective_kind != "nccl") {
      throw py::value_error(
          absl::StrCat("collective: must be 'gloo' or 'nccl', got '", collective_kind, "'"));
    }
    if (collective_kind == "nccl" && reduction != "trainer") {
      throw py::value_error(
          "collective: 'nccl' is the trainer collective; pass reduction='trainer'");
    }
    if (reduction == "trainer") {
      if (const char* dir = std::getenv("ZS_COLLECTIVE_DIR");
          (!collective_dir.has_value() || collective_dir->empty()) && dir != nullptr) {
        collective_dir = dir;  // zsrun's, the same for every rank of the run
      }
      if (!collective_dir.has_value() || collective_dir->empty()) {
        throw py::value_error(
            "collective_dir: reduction='trainer' needs the rendezvous directory, the same "
            "path for every rank (one host, or a filesystem every node mounts); zsrun sets "
            "ZS_COLLECTIVE_DIR");
      }
      if (collective_kind == "gloo") {
        GlooCollective::Options o;
        o.rendezvous_dir = *collective_dir;
        o.hostname = collective_host;
        collective = Check(GlooCollective::Create(o));
      } else {  // "nccl"
#ifdef ZS_WITH_NCCL
        NcclCollective::Options o;
        o.rendezvous_dir = *collective_dir;
        collective = Check(NcclCollective::Create(o));
#else
        throw py::value_error(
            "collective: 'nccl' needs a build with CUDA and NCCL (nvcc and nccl.h were not found "
            "when this module was built)");
#endif
      }
      c.reduction = ReductionMode::kTrainerCollective;
    } else if (reduction != "daemon") {
      throw py::value_error(
          absl::StrCat("reduction: must be 'daemon' or 'trainer', got '", reduction, "'"));
    }
    c.replicas = replicas;
    c.job_token = token.value_or("");
    c.tls = {tls_cert.value_or(""), tls_key.value_or(""), tls_ca.value_or("")};
    c.insecure = insecure;
    c.daemons = std::move(daemons);
    c.job_id = std::move(job_id);
    c.rank = rank;
    c.world_size = world_size;
    c.stage = stage;
    c.precision = ParsePrecision(precision);
    c.bucket_bytes = bucket_bytes;
    c.optimizer.kind = OptimizerKind::kAdamW;
    c.optimizer.lr = lr;
    c.optimizer.beta1 = betas.first;
    c.optimizer.beta2 = betas.second;
    c.optimizer.eps = eps;
    c.optimizer.weight_decay = weight_decay;
    c.max_grad_norm = max_grad_norm;
    c.rpc_timeout = absl::Seconds(rpc_timeout);
    c.step_timeout = absl::Seconds(step_timeout);
    c.checkpoint_wait = absl::Seconds(checkpoint_wait);
    c.resume = resume.value_or("");
    client_ = Check(Client::Create(std::move(c), std::move(collective)));
  }

  ~PyClient() {
    // The client's destructor waits for its in-flight RPCs (borrowed buffers
    // in lent_ are released after it).
    py::gil_scoped_release release;
    client_.reset();
  }

  void RegisterModel(const Layout& layout, const py::object& initial_params) {
    const float* params = nullptr;
    py::buffer_info info;
    if (!initial_params.is_none()) {
      info = Float32Buffer(initial_params.cast<py::buffer>(), false, layout.total_elements(),
                           "initial_params");
      params = static_cast<const float*>(info.ptr);
    }
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = client_->RegisterModel(layout, params);
    }
    Check(status);
  }

  void PushGradients(uint64_t begin, uint64_t end, const py::object& grads, bool borrow,
                     uint32_t micro_batch, const std::vector<uint32_t>& no_grad) {
    if (end < begin) throw py::value_error("push_gradients: end < begin");
    const void* data = nullptr;
    DType dtype = DType::kFp32;
    MemoryKind memory = MemoryKind::kHost;
    py::buffer_info info;
    if (IsTensor(grads)) {
      const TensorData t = CheckedTensor(grads, end - begin, std::nullopt, "grads");
      data = t.data;
      dtype = t.dtype;
      memory = t.memory;
      if (memory == MemoryKind::kCudaDevice) SyncCurrentStream(grads);
    } else {
      if (!py::isinstance<py::buffer>(grads)) {
        throw py::type_error("grads: expected a float32 buffer or a tensor");
      }
      info = Float32Buffer(grads.cast<py::buffer>(), false, end - begin, "grads");
      data = info.ptr;
    }
    absl::StatusOr<PushTicket> ticket;
    {
      py::gil_scoped_release release;
      ticket = client_->PushGradients({begin, end}, data, dtype, micro_batch,
                                      borrow ? BufferUse::kBorrow : BufferUse::kCopy, memory,
                                      no_grad);
    }
    Check(ticket.status());
    // The client reads a borrowed buffer until the step has taken it in:
    // keep the object alive, and its buffer exported (an array.array or a
    // bytearray with an export cannot be resized, so its memory cannot move),
    // until then. A tensor is kept alive; resizing it in place before the
    // step is the caller's error, as with any tensor torch is reading.
    if (borrow) {
      lent_.push_back(grads);
      if (info.ptr != nullptr) lent_views_.push_back(std::move(info));
    }
  }

  // `lr`: a float (every group's), or a list of each group's.
  py::dict Step(const py::object& lr) {
    absl::StatusOr<StepResult> result;
    if (py::isinstance<py::float_>(lr) || py::isinstance<py::int_>(lr)) {
      const float v = lr.cast<float>();
      py::gil_scoped_release release;
      result = client_->Step(v);
    } else {
      const std::vector<float> lrs = lr.cast<std::vector<float>>();
      py::gil_scoped_release release;
      result = client_->Step(lrs);
    }
    StepResult r = Check(std::move(result));
    lent_views_.clear();  // every push of the step has been accepted
    lent_.clear();
    py::dict d;
    d["step"] = r.step;
    d["skipped"] = r.skipped;
    d["grad_norm"] = r.have_norm ? py::object(py::float_(r.grad_norm)) : py::object(py::none());
    d["clip_coef"] = r.have_norm ? py::object(py::float_(r.clip_coef)) : py::object(py::none());
    d["loss_scale"] = r.loss_scale;
    d["push_wait_ms"] = absl::ToDoubleMilliseconds(r.push_wait);
    return d;
  }

  // `out`: total_elements float32 values (a buffer or tensor), or a tensor
  // of the job's precision (the daemons' half-precision copy).
  void GatherAll(const py::object& out) {
    RequireRegistered("gather_all");
    GatherFlat(FlatRange{0, client_->total_elements()}, out);
  }

  // Flat [begin, end) only, into `out` (end - begin values, as gather_all's).
  void GatherRange(uint64_t begin, uint64_t end, const py::object& out) {
    RequireRegistered("gather_range");
    if (end <= begin || end > client_->total_elements()) {
      throw py::value_error(absl::StrCat("gather_range: [", begin, ", ", end,
                                         ") is empty or outside the flat space [0, ",
                                         client_->total_elements(), ")"));
    }
    GatherFlat(FlatRange{begin, end}, out);
  }

  void GatherFlat(const FlatRange& range, const py::object& out) {
    DType dtype = DType::kFp32;
    if (IsTensor(out)) {
      const std::optional<DType> t = TorchDType(py::str(out.attr("dtype")));
      if (t == client_->config().precision) dtype = *t;
    }
    py::buffer_info keep;
    const TensorData dst = WritableOut(out, range.size(), dtype, "out", &keep);
    if (dst.memory == MemoryKind::kCudaDevice) SyncCurrentStream(out);
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = client_->GatherAll(range, dst.data, dtype, dst.memory);
    }
    Check(status);
  }

  // Stage 3: layer `layer`'s parameters as of the last committed step into
  // `out` (layer_elements values of the job's precision, alignment gaps
  // included). Served from the client's prefetch when there is one; starts
  // prefetching the next layers in the direction of travel.
  void Gather(uint32_t layer, const py::object& out) {
    RequireRegistered("gather");
    const uint64_t elements = Check(client_->layer_elements(layer));
    py::buffer_info keep;
    const TensorData dst = WritableOut(out, elements, client_->config().precision, "out", &keep);
    if (dst.memory == MemoryKind::kCudaDevice) SyncCurrentStream(out);
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = client_->Gather(layer, dst.data, dst.memory);
    }
    Check(status);
  }

  void Release(uint32_t layer) {
    RequireRegistered("release");
    Check(client_->Release(layer));
  }

  void Prefetch(uint32_t layer) {
    RequireRegistered("prefetch");
    Check(client_->Prefetch(layer));
  }

  PyPushMemory AllocatePushMemory(uint64_t bytes) {
    return PyPushMemory(Check(client_->AllocatePushMemory(bytes)));
  }

  void Leave() {
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = client_->Leave();
    }
    Check(status);
  }

  py::dict MemoryReport() const {
    ClientMemoryReport r = client_->MemoryReport();
    py::dict d;
    d["buffer"] = r.buffer;
    d["param"] = r.param;
    d["param_half"] = r.param_half;
    d["total"] = r.total();
    return d;
  }

  py::dict TrafficReport() const {
    ClientTrafficReport r = client_->TrafficReport();
    py::dict d;
    d["total"] = TrafficDict(r.total);
    d["last_step"] = TrafficDict(r.last_step);
    d["current"] = TrafficDict(r.current);
    d["prefetch_hits"] = r.prefetch_hits;
    d["prefetch_misses"] = r.prefetch_misses;
    return d;
  }

  py::dict SaveCheckpoint(const std::string& name) {
    absl::StatusOr<CheckpointStarted> started;
    {
      py::gil_scoped_release release;
      started = client_->SaveCheckpoint(name);
    }
    CheckpointStarted r = Check(std::move(started));
    py::dict d;
    d["name"] = r.name;
    d["step"] = r.step;
    d["bytes"] = r.bytes;
    d["snapshot_seconds"] = r.snapshot_seconds;
    // Why the save before this one did not complete; empty when it did.
    d["previous_error"] = r.previous.ok() ? std::string() : r.previous.ToString();
    return d;
  }

  py::dict AwaitCheckpoint() {
    absl::StatusOr<CheckpointCompleted> completed;
    {
      py::gil_scoped_release release;
      completed = client_->AwaitCheckpoint();
    }
    CheckpointCompleted r = Check(std::move(completed));
    py::dict d;
    d["name"] = r.name;
    d["step"] = r.step;
    d["bytes"] = r.bytes;
    d["write_seconds"] = r.write_seconds;
    return d;
  }

  py::list ListCheckpoints() {
    absl::StatusOr<std::vector<v1::CheckpointInfo>> listed;
    {
      py::gil_scoped_release release;
      listed = client_->ListCheckpoints();
    }
    py::list out;
    for (const v1::CheckpointInfo& c : Check(std::move(listed))) {
      py::dict d;
      d["name"] = c.name();
      d["step"] = c.step();
      d["world_size"] = c.world_size();
      d["daemon_count"] = c.daemon_count();
      d["stage"] = c.stage();
      d["bytes"] = c.bytes();
      d["completed_unix_ms"] = c.completed_unix_ms();
      out.append(std::move(d));
    }
    return out;
  }

  py::object ResumedFrom() const {
    const std::optional<v1::LoadCheckpointResponse>& r = client_->resumed_from();
    if (!r.has_value()) return py::none();
    py::dict d;
    d["name"] = r->name();
    d["step"] = r->step();
    d["bytes_read"] = r->bytes_read();
    d["seconds"] = r->seconds();
    return std::move(d);
  }

  // The committed `array` over [begin, end) into `out` (end - begin float32
  // values, a buffer or tensor); returns {tensor index: update count} of the
  // trainable tensors overlapping the range.
  std::map<uint32_t, uint64_t> ReadState(const std::string& array, uint64_t begin, uint64_t end,
                                         const py::object& out) {
    RequireRegistered("read_state");
    if (end < begin) throw py::value_error("read_state: end < begin");
    const v1::StateArray a = ParseStateArray(array);
    py::buffer_info keep;
    const TensorData dst = WritableOut(out, end - begin, DType::kFp32, "out", &keep);
    if (dst.memory != MemoryKind::kHost) throw py::type_error("out: must be in host memory");
    std::map<uint32_t, uint64_t> steps;
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = client_->ReadState(a, {begin, end}, static_cast<float*>(dst.data), &steps);
    }
    Check(status);
    return steps;
  }

  // Overwrites `array` over [begin, end) with `values` (end - begin float32,
  // a buffer or tensor; None when end == begin) and sets `steps` ({tensor
  // index: update count}).
  void WriteState(const std::string& array, uint64_t begin, uint64_t end, const py::object& values,
                  const std::map<uint32_t, uint64_t>& steps) {
    RequireRegistered("write_state");
    if (end < begin) throw py::value_error("write_state: end < begin");
    const v1::StateArray a = ParseStateArray(array);
    const float* src = nullptr;
    py::buffer_info keep;
    if (end > begin) {
      if (IsTensor(values)) {
        const TensorData t = CheckedTensor(values, end - begin, DType::kFp32, "values");
        if (t.memory != MemoryKind::kHost) throw py::type_error("values: must be in host memory");
        src = static_cast<const float*>(t.data);
      } else {
        keep = Float32Buffer(values.cast<py::buffer>(), false, end - begin, "values");
        src = static_cast<const float*>(keep.ptr);
      }
    }
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = client_->WriteState(a, {begin, end}, src, steps);
    }
    Check(status);
  }

  uint64_t total_elements() const { return client_->total_elements(); }

  std::pair<uint64_t, uint64_t> PartitionRange(uint32_t rank) const {
    RequireRegistered("partition_range");
    if (rank >= client_->partition_map().world_size()) {
      throw py::value_error(absl::StrCat("rank: must be < world_size (",
                                         client_->partition_map().world_size(), "), got ", rank));
    }
    const FlatRange r = client_->partition_map().Partition(rank);
    return {r.begin, r.end};
  }
  uint64_t committed_step() const { return client_->committed_step(); }
  float loss_scale() const { return client_->loss_scale(); }
  bool carries_no_grad_marks() const { return client_->carries_no_grad_marks(); }
  // The job's loss scaling as registered (ClientConfig.loss_scale).
  py::dict LossScaleSettingsDict() const {
    const LossScaleSettings& s = client_->config().loss_scale;
    py::dict d;
    d["dynamic"] = s.dynamic;
    d["init_scale"] = s.initial_scale;
    d["growth_factor"] = s.growth_factor;
    d["backoff_factor"] = s.backoff_factor;
    d["growth_interval"] = s.growth_interval;
    return d;
  }

  // `daemon`: an index into daemons; None: this rank's partition's daemon
  // (rank * len(daemons) / world_size).
  std::unique_ptr<PyActivationStore> OpenActivationStore(std::optional<uint32_t> daemon,
                                                         int threads, bool checksums,
                                                         std::optional<double> rpc_timeout) {
    const ClientConfig& c = client_->config();
    DaemonSliceStore::Options o;
    o.threads = threads;
    o.checksums = checksums;
    if (rpc_timeout.has_value() && !(*rpc_timeout > 0)) {
      throw py::value_error("rpc_timeout: must be > 0 seconds");
    }
    o.rpc_timeout = rpc_timeout.has_value() ? absl::Seconds(*rpc_timeout) : c.rpc_timeout;
    const uint32_t d = daemon.value_or(static_cast<uint32_t>(
        uint64_t{c.rank} * c.daemons.size() / std::max<uint32_t>(1, c.world_size)));
    return std::make_unique<PyActivationStore>(Check(client_->OpenActivationStore(d, o)));
  }

 private:
  void RequireRegistered(const char* what) const {
    if (client_->total_elements() == 0) {
      ThrowStatus(absl::FailedPreconditionError(
          absl::StrCat(what, ": call register_model first")));
    }
  }

  std::unique_ptr<Client> client_;
  // Buffers lent by push_gradients(borrow=True) since the last successful
  // step; touched with the GIL held.
  std::vector<py::object> lent_;
  // The buffer exports of those that are buffers, held as long.
  std::vector<py::buffer_info> lent_views_;
};

std::vector<uint64_t> Offsets(const Layout& layout) {
  std::vector<uint64_t> v;
  for (const TensorPlacement& t : layout.tensors()) v.push_back(t.offset);
  return v;
}

std::vector<uint64_t> Numels(const Layout& layout) {
  std::vector<uint64_t> v;
  for (const TensorPlacement& t : layout.tensors()) v.push_back(t.numel);
  return v;
}

std::pair<uint64_t, uint64_t> LayerRange(const Layout& layout, uint32_t layer) {
  FlatRange r = Check(layout.LayerRange(layer));
  return {r.begin, r.end};
}

std::vector<uint32_t> TensorLayers(const Layout& layout) {
  std::vector<uint32_t> v;
  for (const TensorPlacement& t : layout.tensors()) v.push_back(t.spec.layer);
  return v;
}

}  // namespace
}  // namespace zeroshard::python

PYBIND11_MODULE(_zeroshard, m) {
  namespace py = pybind11;
  using namespace zeroshard;          // NOLINT: the module's one scope
  using namespace zeroshard::python;  // NOLINT
  m.doc() = "ZeRO-as-a-service client: push gradients, step, gather parameters.";

  g_error_type = PyErr_NewExceptionWithDoc(
      "zeroshard.Error",
      "A zeroshard call failed; .code is the status code name (e.g. 'UNAVAILABLE').",
      PyExc_RuntimeError, nullptr);
  m.add_object("Error", py::handle(g_error_type));

  py::class_<Layout>(m, "Layout",
                     "The flat parameter space: each tensor starts at a multiple of the "
                     "alignment (64 elements by default); gaps hold zeros.")
      .def(py::init(&MakeLayout), py::arg("tensors"), py::arg("alignment") = 0,
           "tensors: list of (name, shape, layer[, group[, frozen[, aliases]]]), layers "
           "non-decreasing; group indexes the client's param_groups (default 0); frozen "
           "tensors are never updated and hold no optimizer state; aliases are other names "
           "of the tensor (tied weights), kept in exports.")
      .def_property_readonly("offsets", &Offsets, "First flat element of each tensor.")
      .def_property_readonly("numels", &Numels)
      .def_property_readonly("tensor_layers", &TensorLayers, "The layer of each tensor.")
      .def_property_readonly("layers", &Layout::layers, "Distinct layer ids, ascending.")
      .def("layer_range", &LayerRange, py::arg("layer"),
           "(begin, end): the flat range of the layer's tensors, from its first tensor's "
           "offset to the aligned end of its last. Raises NOT_FOUND for an unknown layer.")
      .def_property_readonly("total_elements", &Layout::total_elements,
                             "Size of the flat space, gaps included.")
      .def_property_readonly("parameter_count", &Layout::parameter_count)
      .def_property_readonly("alignment", &Layout::alignment);

  // The C++ defaults Client(...) takes its own from.
  const ClientConfig defaults;
  const GlooCollective::Options gloo_defaults;
  const DaemonSliceStore::Options store_defaults;
  m.attr("DEFAULTS") = ClientDefaults(defaults, gloo_defaults);

  py::class_<PyClient>(m, "Client")
      .def(py::init<std::vector<std::string>, std::string, uint32_t, uint32_t, uint32_t,
                    const std::string&, float, std::pair<float, float>, float, float, float,
                    uint64_t, double, double, std::optional<std::string>,
                    std::optional<std::string>, std::optional<std::string>,
                    std::optional<std::string>, std::optional<std::string>, uint32_t,
                    const std::string&, std::optional<std::string>, const std::string&,
                    std::optional<int>, const std::string&, const py::object&, uint32_t,
                    bool, const std::string&, const std::string&, const py::object&, bool,
                    int, double, bool>(),
           py::arg("daemons"), py::arg("job_id"), py::arg("rank"), py::arg("world_size"),
           py::arg("stage") = defaults.stage,
           py::arg("precision") = std::string(DTypeName(kPythonDefaultPrecision)),
           py::arg("lr") = defaults.optimizer.lr,
           py::arg("betas") = std::make_pair(defaults.optimizer.beta1, defaults.optimizer.beta2),
           py::arg("eps") = defaults.optimizer.eps,
           py::arg("weight_decay") = defaults.optimizer.weight_decay,
           py::arg("max_grad_norm") = defaults.max_grad_norm,
           py::arg("bucket_bytes") = defaults.bucket_bytes,
           py::arg("rpc_timeout") = absl::ToDoubleSeconds(defaults.rpc_timeout),
           py::arg("step_timeout") = absl::ToDoubleSeconds(defaults.step_timeout),
           py::arg("resume") = py::none(), py::arg("token") = py::none(),
           py::arg("tls_cert") = py::none(), py::arg("tls_key") = py::none(),
           py::arg("tls_ca") = py::none(), py::arg("replicas") = defaults.replicas,
           py::arg("reduction") = ReductionName(defaults.reduction),
           py::arg("collective_dir") = py::none(),
           py::arg("collective_host") = gloo_defaults.hostname,
           py::arg("cuda_device") = CudaDeviceArg(defaults.cuda_device),
           py::arg("collective") = kDefaultCollective, py::arg("param_groups") = py::none(),
           py::arg("micro_batches") = defaults.micro_batches,
           py::arg("insecure") = defaults.insecure,
           py::arg("transport") = defaults.transport, py::arg("ucx_tls") = defaults.ucx_tls,
           py::arg("loss_scale") = py::none(), py::arg("node_cache") = defaults.node_cache,
           py::arg("local_daemon") = defaults.local_daemon,
           py::arg("checkpoint_wait") = absl::ToDoubleSeconds(defaults.checkpoint_wait),
           py::arg("push_memory") = defaults.push_memory,
           "Validates the config and starts the client's threads; connects to nothing. "
           "token: the job's secret (default: $ZS_JOB_TOKEN, which zsrun sets; required); "
           "tls_cert/tls_key/tls_ca: PEM files for mutual TLS to the daemons (default: "
           "$ZS_TLS_CERT/_KEY/_CA; none: plaintext, which is refused to a daemon address that is "
           "not loopback unless insecure=True or $ZS_INSECURE=1). "
           "Timeouts in seconds. resume: None, a checkpoint name or 'latest' (the complete "
           "checkpoint with the highest step): register_model on rank 0 then loads it into "
           "the daemons instead of uploading initial_params ('latest' with no complete "
           "checkpoint starts from initial_params). replicas: 1, or 2 for a primary and a backup "
           "of each daemon's partitions (a daemon may die; a new Client then continues at the "
           "committed step, the leader promoting the backups). reduction: 'daemon' (every rank "
           "pushes its whole gradient) or 'trainer' (the ranks reduce-scatter the gradients and "
           "all-gather the parameters among themselves, each moving only its own partition "
           "with the daemons; collective_dir is the rendezvous directory every rank shares, "
           "ZS_COLLECTIVE_DIR by default (zsrun sets it); no "
           "reconnect). collective, for reduction='trainer': 'gloo' (CPU tensors, over Gloo's "
           "TCP transport on collective_host) or 'nccl' (CUDA tensors of cuda_device, one GPU "
           "per rank, over NCCL; collective_host is not used; only in a build with CUDA and "
           "NCCL). cuda_device: the CUDA device whose tensors push_gradients, gather_all and "
           "gather may be given (with daemon reduction cast and copied through pinned host "
           "buffers); None: CPU tensors only. A build without CUDA, or a machine without the "
           "device, raises. param_groups: None (one group: lr, betas, eps, weight_decay) or a list of "
           "dicts with keys lr, betas, eps, weight_decay, one per parameter group (a layout "
           "tensor's group indexes it). micro_batches: gradient accumulation: how many times "
           "each range is pushed per step (micro_batch 0..micro_batches-1). "
           "transport: the data path for gradients, parameters and activations: 'stream' (the "
           "Shard streaming RPCs, which every daemon serves) or a bulk transport, which must be "
           "the daemons' --bulk_transport: 'ucx', 'grpc' (one-sided Put/Get over gRPC) or "
           "'inproc' (daemons in this process); raises UNAVAILABLE when UCX cannot start. "
           "ucx_tls: UCX_TLS of a 'ucx' transport, e.g. 'posix,cma,self' or 'tcp' (empty: "
           "UCX's choice or $UCX_TLS). "
           "loss_scale: what the daemons divide the pushed gradients by (every rank passes the "
           "same): None (a static 1), a number (a static scale), or a dict of "
           "torch.cuda.amp.GradScaler's arguments init_scale, growth_factor, backoff_factor, "
           "growth_interval (each optional, GradScaler's default otherwise) for dynamic "
           "scaling: a step whose gradients hold an inf or NaN is skipped and the scale "
           "multiplied by backoff_factor; after growth_interval steps in a row that were not "
           "skipped it is multiplied by growth_factor. The loss must be multiplied by "
           "the `loss_scale` property before backward. "
           "node_cache: the job's node cache (every rank passes the same; not with replicas=2): "
           "a rank's streamed gathers of other daemons' ranges are served by its host's daemon, "
           "which fetches each range once per committed step for all its local ranks. "
           "local_daemon: with node_cache, the index in daemons of this rank's host daemon; -1 "
           "(the default): the first daemon whose host is one of this machine's addresses, and "
           "without one the rank gathers from every owner (said on stderr). "
           "push_memory: on a bulk transport, keep the client's gradient staging pool in push "
           "memory (allocate_push_memory), so that a daemon on the same host sums staged "
           "buckets from it in place instead of from a copy in its staging slot; zeroshard.torch "
           "also keeps large gradients there.")
      .def(
          "register_model",
          [](PyClient& self, const py::object& layout, const py::object& initial_params) {
            if (py::isinstance<Layout>(layout)) {
              self.RegisterModel(layout.cast<const Layout&>(), initial_params);
            } else {
              self.RegisterModel(MakeLayout(layout.cast<py::list>(), 0), initial_params);
            }
          },
          py::arg("layout"), py::arg("initial_params") = py::none(),
          "Registers and joins the job; rank 0 uploads initial_params (total_elements "
          "float32 values). Blocks until every rank has joined.")
      .def("push_gradients", &PyClient::PushGradients, py::arg("begin"), py::arg("end"),
           py::arg("grads"), py::arg("borrow") = false, py::arg("micro_batch") = 0u,
           py::arg("no_grad") = std::vector<uint32_t>(),
           "Contributes gradients for flat [begin, end) to the next step: a float32 "
           "buffer, or a contiguous CPU tensor of float32, bfloat16 or float16 (converted "
           "to the job's precision, the wire dtype). The values are copied before it returns, or "
           "with borrow=True read from `grads` "
           "until the next successful step() (one copy fewer; the client keeps a "
           "reference, and the caller must not change the values before then). micro_batch: "
           "of the step (< micro_batches). no_grad: layout indices (ascending, overlapping the "
           "range) of tensors this push has no gradient for (zeros in their place): the step "
           "skips a tensor unless some rank pushed a gradient for it, as torch.optim skips a "
           "parameter whose grad is None.")
      .def("read_state", &PyClient::ReadState, py::arg("array"), py::arg("begin"),
           py::arg("end"), py::arg("out"),
           "Reads the committed 'master', 'exp_avg' or 'exp_avg_sq' over flat [begin, end) "
           "into out (end - begin float32 values; gaps and frozen tensors' moments as 0); "
           "returns {tensor index: update count} of the trainable tensors overlapping it. "
           "Between steps.")
      .def("write_state", &PyClient::WriteState, py::arg("array"), py::arg("begin"),
           py::arg("end"), py::arg("values"), py::arg("steps") = std::map<uint32_t, uint64_t>(),
           "Overwrites 'master', 'exp_avg' or 'exp_avg_sq' over flat [begin, end) with values "
           "(end - begin float32; 0 in gaps, and in frozen tensors for moments) and sets the "
           "update counts in steps ({tensor index: count}); each daemon applies its part whole "
           "or not at all. Between steps; every rank may write the same values.")
      .def("step", &PyClient::Step, py::arg("lr"),
           "Runs the two-phase step with lr (every group's) or a list of each parameter "
           "group's learning rate; returns dict(step, grad_norm, clip_coef, skipped, "
           "loss_scale). grad_norm and clip_coef are None where this rank does not know "
           "them (rank 0 always does).")
      .def("gather_all", &PyClient::GatherAll, py::arg("out"),
           "Writes every parameter of the last committed step into out: total_elements "
           "float32 values (a buffer or tensor; the daemons' fp32 masters), or a tensor of "
           "the job's precision (torch.bfloat16 in a bf16 job: the daemons' bf16 copy).")
      .def("gather_range", &PyClient::GatherRange, py::arg("begin"), py::arg("end"),
           py::arg("out"),
           "gather_all of flat elements [begin, end) only, into out (end - begin values, "
           "float32 or the job's precision): a layer's fp32 masters in a bf16 or fp16 job "
           "without a buffer for the whole model. Every rank gathers the same ranges in the "
           "same order when the trainer collective gathers parameters.")
      .def("save_checkpoint", &PyClient::SaveCheckpoint, py::arg("name"),
           "Saves the committed state under `name` (one rank, between steps; the daemons "
           "need --checkpoint_dir). Waits (up to checkpoint_wait seconds, 10 by default) for this "
           "client's previous save to complete, then returns once every daemon holds its "
           "snapshot: dict(name, step, bytes, snapshot_seconds, previous_error: why the "
           "previous save did not complete, or empty). The daemons write in the background and "
           "the client completes the checkpoint when every part is on disk; training may go on "
           "meanwhile. Raises UNAVAILABLE, nothing saved, while the previous save is not "
           "complete or a daemon's checkpoint disk does not answer: training may go on.")
      .def("await_checkpoint", &PyClient::AwaitCheckpoint,
           "Waits (up to step_timeout) for the last save to complete: dict(name, step, bytes, "
           "write_seconds). Raises FAILED_PRECONDITION if there was none.")
      .def("list_checkpoints", &PyClient::ListCheckpoints,
           "The job's checkpoints complete on every daemon, by step: a list of dict(name, "
           "step, world_size, daemon_count, stage, bytes, completed_unix_ms).")
      .def_property_readonly("resumed_from", &PyClient::ResumedFrom,
                             "On rank 0 after register_model with resume: dict(name, step, "
                             "bytes_read, seconds) of the checkpoint it loaded; None otherwise "
                             "(and on the other ranks).")
      .def("gather", &PyClient::Gather, py::arg("layer"), py::arg("out"),
           "Stage 3: writes the layer's parameters as of the last committed step into out, "
           "in the job's precision: a float32 buffer or contiguous CPU float32 tensor in an "
           "fp32 job, a contiguous CPU torch.bfloat16 (torch.float16) tensor in a bf16 (fp16) "
           "job, of the layer_range's size (gaps read as zeros). "
           "Uses a prefetched copy when there is one, then prefetches the next layers in "
           "the direction of travel (forward while layer ids increase).")
      .def("release", &PyClient::Release, py::arg("layer"),
           "Stage 3: drops the client's prefetched copy of the layer, if any.")
      .def("prefetch", &PyClient::Prefetch, py::arg("layer"),
           "Stage 3: starts gathering the layer in the background (a no-op when it is "
           "there already or no layer buffer is free); returns at once.")
      .def("leave", &PyClient::Leave)
      .def("allocate_push_memory", &PyClient::AllocatePushMemory, py::arg("bytes"),
           "Gradient memory a daemon on the same host sums from in place: `bytes` rounded up "
           "to whole pages, zeroed; wrap it with torch.frombuffer(memory, dtype=torch.float32). "
           "push_gradients(borrow=True) from it on a bulk transport is not copied into the "
           "daemon's staging slot where the daemon can map it (else it is sent as from any "
           "memory). A daemon keeps what it mapped until this rank leaves and maps at most 16 "
           "per rank process (the client's staging pool is one): allocate few, long-lived "
           "memories. Raises RESOURCE_EXHAUSTED when the system refuses the memory.")
      .def("memory_report", &PyClient::MemoryReport)
      .def("traffic_report", &PyClient::TrafficReport)
      .def_property_readonly("total_elements", &PyClient::total_elements,
                             "0 until register_model succeeds.")
      .def_property_readonly("committed_step", &PyClient::committed_step)
      .def_property_readonly("loss_scale_settings", &PyClient::LossScaleSettingsDict,
                             "The job's loss scaling as registered: dict(dynamic, init_scale, "
                             "growth_factor, backoff_factor, growth_interval); a static scale "
                             "(dynamic False) never moves.")
      .def_property_readonly("loss_scale", &PyClient::loss_scale,
                             "The scale to multiply the next step's loss by: the "
                             "job's initial scale until a step returns (the daemons' "
                             "current one for a rank joining a job past step 0), then "
                             "the one that step's commit left (the daemons move it).")
      .def_property_readonly("carries_no_grad_marks", &PyClient::carries_no_grad_marks,
                             "Whether push_gradients takes no_grad marks with this "
                             "client's collective: daemon reduction and the Gloo "
                             "trainer collective do, the NCCL one does not.")
      .def("partition_range", &PyClient::PartitionRange, py::arg("rank"),
           "(begin, end): the flat range of rank's partition (padding included: end may "
           "pass total_elements).")
      .def("open_activation_store", &PyClient::OpenActivationStore, py::keep_alive<0, 1>(),
           py::arg("daemon") = py::none(), py::arg("threads") = store_defaults.threads,
           py::arg("checksums") = store_defaults.checksums, py::arg("rpc_timeout") = py::none(),
           "After register_model: an ActivationStore for this rank's activation checkpoints "
           "on daemon `daemon` (an index into daemons; None: rank * len(daemons) // "
           "world_size, the rank's partition's daemon), held in its activation arena "
           "(zeroshardd --activation_arena_bytes) or spill files, over the client's transport. "
           "threads: its workers (1..16); checksums: a CRC-32C with every slice on a bulk "
           "transport (the streaming RPCs always check); rpc_timeout: seconds per operation "
           "(None: the client's). The client lives as long as the store.");

  py::class_<PyPushMemory>(m, "PushMemory", py::buffer_protocol(),
                           "Client.allocate_push_memory's memory: a writable float32 buffer.")
      .def_buffer(&PyPushMemory::Buffer)
      .def_property_readonly("nbytes", &PyPushMemory::nbytes, "Its size in bytes.");

  py::class_<PyActivationTicket>(m, "ActivationTicket",
                                 "An activation store operation running in the background.")
      .def_property_readonly("done", &PyActivationTicket::done)
      .def("wait", &PyActivationTicket::Wait, py::arg("timeout") = py::none(),
           "Blocks until the operation ends (raising its error) or `timeout` seconds pass "
           "(DEADLINE_EXCEEDED; the operation goes on).");

  py::class_<PyActivationStore>(
      m, "ActivationStore",
      "Activation checkpoints of this rank on one daemon (client/activation_store.h), by key "
      "(step, micro_batch, layer): a slice is the bytes of one CPU tensor whose elements are "
      "dense (contiguous or permuted), of any dtype. Operations run on the store's threads in "
      "submission order per key (a fetch waits for the offload of its key submitted before); "
      "the store holds the tensors they read or write until they end.")
      .def_property_readonly("name", &PyActivationStore::Name,
                             "'daemon <address> (<data path>)'.")
      .def("offload", &PyActivationStore::Offload, py::arg("step"), py::arg("layer"),
           py::arg("tensor"), py::arg("micro_batch") = 0u,
           "Starts storing the tensor's bytes under the key; returns an ActivationTicket. The "
           "tensor must not change until the ticket is done. ALREADY_EXISTS for a key stored.")
      .def("start_fetch", &PyActivationStore::StartFetch, py::arg("step"), py::arg("layer"),
           py::arg("out"), py::arg("micro_batch") = 0u, py::arg("free") = true,
           "Starts fetching the slice into `out` (a tensor of exactly its bytes, laid out as "
           "the one offloaded: torch.empty_strided with its size, stride and dtype); returns "
           "an ActivationTicket. free: drop the slice on the daemon once fetched.")
      .def(
          "fetch",
          [](PyActivationStore& self, uint64_t step, uint32_t layer, const py::object& out,
             uint32_t micro_batch, bool free, std::optional<double> timeout) {
            self.StartFetch(step, layer, out, micro_batch, free).Wait(timeout);
          },
          py::arg("step"), py::arg("layer"), py::arg("out"), py::arg("micro_batch") = 0u,
          py::arg("free") = true, py::arg("timeout") = py::none(),
          "start_fetch and wait for it.")
      .def("prefetch", &PyActivationStore::Prefetch, py::arg("keys"),
           "A hint: these slices ((step, micro_batch, layer) tuples) will be fetched soon, in "
           "this order; the daemon reads spilled ones back into its arena.")
      .def("free", &PyActivationStore::Free, py::arg("step"), py::arg("layer"),
           py::arg("micro_batch") = 0u, py::arg("timeout") = py::none(),
           "Frees one slice (after the operations on it submitted before); returns the bytes "
           "freed (0 if it was not there).")
      .def("free_step", &PyActivationStore::FreeStep, py::arg("step"),
           py::arg("timeout") = py::none(),
           "Frees every slice of `step` this store offloaded; returns the bytes freed.")
      .def("stats", &PyActivationStore::Stats,
           "dict(stored_bytes, peak_stored_bytes, trainer_bytes, peak_trainer_bytes, offloads, "
           "fetches, offload_bytes, fetch_bytes, failures, spilled_offloads, spilled_fetches, "
           "streamed): SliceStoreStats.")
      .def("close", &PyActivationStore::Close,
           "Waits for the operations in flight and drops the store (slices not freed stay on "
           "the daemon until the job ends there).");
}
