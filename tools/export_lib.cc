#include "tools/export_lib.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/checkpoint_files.h"
#include "common/format.h"
#include "common/job_id.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "common/status_macros.h"

namespace zeroshard::tools {
namespace {

absl::Status OutputError(int err, absl::string_view what, absl::string_view path) {
  const std::string msg = absl::StrCat("--out: ", what, " ", path, ": ", std::strerror(err));
  switch (err) {
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
      return absl::ResourceExhaustedError(msg);
    case ENOENT:
    case ENOTDIR:
    case EISDIR:
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// An uninitialised fp32 tensor; libtorch throws when it cannot allocate.
absl::StatusOr<at::Tensor> EmptyTensor(const TensorSpec& spec) {
  try {
    return at::empty(spec.shape, at::kFloat);
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("tensor ", spec.name, ": cannot allocate: ", e.what()));
  }
}

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

absl::StatusOr<CheckpointPath> SplitCheckpointPath(absl::string_view path) {
  const std::string original(path);
  while (path.size() > 1 && absl::ConsumeSuffix(&path, "/")) {
  }
  const size_t name_slash = path.rfind('/');
  if (path.empty() || name_slash == absl::string_view::npos || name_slash == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checkpoint: expected DIR/JOB/NAME (the daemons' --checkpoint_dir, the job id and the "
        "checkpoint name), got \"", original, "\""));
  }
  CheckpointPath out;
  out.name = std::string(path.substr(name_slash + 1));
  absl::string_view rest = path.substr(0, name_slash);
  const size_t job_slash = rest.rfind('/');
  if (job_slash == absl::string_view::npos) {
    out.root = ".";
    out.job_id = std::string(rest);
  } else {
    out.root = job_slash == 0 ? "/" : std::string(rest.substr(0, job_slash));
    out.job_id = std::string(rest.substr(job_slash + 1));
  }
  if (!IsValidJobId(out.job_id)) {
    return absl::InvalidArgumentError(absl::StrCat("--checkpoint: job \"", out.job_id, "\" in \"",
                                                   original, "\" is not a job id (", kJobIdRule,
                                                   ")"));
  }
  if (absl::Status s = ValidateCheckpointName(out.name, /*allow_latest=*/true); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--checkpoint: \"", original, "\": ", s.message()));
  }
  return out;
}

absl::StatusOr<std::vector<std::pair<std::string, at::Tensor>>> ReadMasterTensors(
    const std::string& root, const v1::CheckpointManifest& manifest, uint64_t* bytes_read,
    uint64_t window_elements) {
  ASSIGN_OR_RETURN(const Layout layout, LayoutFromProto(manifest.spec().layout()),
                   "checkpoint ", manifest.job_id(), "/", manifest.name(), " ", kManifestFile);
  if (layout.total_elements() != manifest.partition_map().total_elements()) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint ", manifest.job_id(), "/", manifest.name(), ": ", kManifestFile,
        "'s layout spans ", layout.total_elements(), " elements, its partition map ",
        manifest.partition_map().total_elements()));
  }
  const CheckpointReader reader(root, manifest);
  RETURN_IF_ERROR(reader.CheckReadable({0, layout.total_elements()}, {kMasterFile}),
                  "the export reads every part from ", root,
                  ": copy the parts of every daemon's --checkpoint_dir there");

  const std::vector<TensorPlacement>& placements = layout.tensors();
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.reserve(placements.size());
  // A tied tensor goes in under its name and each alias, as
  // module.state_dict() lists it.
  auto emit = [&out](const TensorSpec& spec, at::Tensor t) {
    out.emplace_back(spec.name, t);
    for (const std::string& alias : spec.aliases) out.emplace_back(alias, t);
  };
  std::vector<float> window;
  size_t i = 0;
  while (i < placements.size()) {
    const TensorPlacement& first = placements[i];
    if (first.numel > window_elements) {
      // A large tensor is read straight into its own memory.
      ASSIGN_OR_RETURN(at::Tensor t, EmptyTensor(first.spec));
      RETURN_IF_ERROR(reader.ReadRange(kMasterFile, first.range(), t.data_ptr<float>(),
                                       bytes_read),
                      "tensor ", first.spec.name);
      emit(first.spec, std::move(t));
      ++i;
      continue;
    }
    // The small tensors that fit one window from here on.
    size_t end = i + 1;
    while (end < placements.size() &&
           placements[end].range().end - first.offset <= window_elements) {
      ++end;
    }
    const FlatRange span{first.offset, placements[end - 1].range().end};
    window.resize(span.size());
    RETURN_IF_ERROR(reader.ReadRange(kMasterFile, span, window.data(), bytes_read), "tensors ",
                    first.spec.name, "..", placements[end - 1].spec.name);
    for (; i < end; ++i) {
      const TensorPlacement& p = placements[i];
      ASSIGN_OR_RETURN(at::Tensor t, EmptyTensor(p.spec));
      std::memcpy(t.data_ptr<float>(), window.data() + (p.offset - span.begin),
                  p.numel * sizeof(float));
      emit(p.spec, std::move(t));
    }
  }
  return out;
}

absl::Status WriteTensorDict(const std::string& path,
                             const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  if (path.empty() || path.back() == '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("--out: expected a file name, got \"", path, "\""));
  }
  const std::string dir = DirectoryOf(path);
  const std::string base = path.substr(path.rfind('/') + 1);
  if (::access(dir.c_str(), W_OK) != 0) return OutputError(errno, "writing into", dir);
  return WriteFileAtomically(dir, base, [&](int fd, const std::string& tmp) -> absl::Status {
    // The writer callbacks below cannot return a status: the first error is
    // kept here, and libtorch then throws, which is caught below.
    absl::Status write_error;
    auto write_all = [&](const void* data, size_t n) -> size_t {
      const char* p = static_cast<const char*>(data);
      size_t done = 0;
      while (done < n && write_error.ok()) {
        const ssize_t w = ::write(fd, p + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
          write_error = OutputError(w < 0 ? errno : ENOSPC, "writing", tmp);
          break;
        }
        done += static_cast<size_t>(w);
      }
      return done;
    };
    try {
      c10::Dict<std::string, at::Tensor> dict;
      for (const auto& [name, tensor] : tensors) dict.insert(name, tensor);
      // The pickle references each tensor's storage by index; the storages
      // follow it in the archive as data/<index>, as torch.save lays them
      // out. Without type tags: a plain dict, not a torch.jit._pickle call,
      // which weights_only unpicklers refuse.
      std::vector<char> pickle;
      torch::jit::Pickler pickler(
          [&pickle](const char* data, size_t n) { pickle.insert(pickle.end(), data, data + n); },
          /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
          /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
      pickler.protocol();
      pickler.pushIValue(c10::IValue(dict));
      pickler.stop();
      caffe2::serialize::PyTorchStreamWriter writer(write_all);
      torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(),
                                         pickler.tensorData(), writer);
      writer.writeEndOfFile();
    } catch (const std::exception& e) {
      if (!write_error.ok()) return write_error;
      return absl::InternalError(absl::StrCat("--out: serializing ", path, ": ", e.what()));
    }
    return write_error;
  });
}

absl::StatusOr<std::string> RunExport(const ExportOptions& options) {
  if (options.checkpoint.empty()) {
    return absl::InvalidArgumentError(
        "--checkpoint is required: DIR/JOB/NAME, e.g. /ckpt/run42/step-1000 or /ckpt/run42/latest");
  }
  if (options.out.empty()) {
    return absl::InvalidArgumentError("--out is required, e.g. --out=model.pt");
  }
  ASSIGN_OR_RETURN(const CheckpointPath where, SplitCheckpointPath(options.checkpoint));
  ASSIGN_OR_RETURN(const std::string name,
                   ResolveCheckpointName(where.root, where.job_id, where.name));
  ASSIGN_OR_RETURN(const v1::CheckpointManifest manifest,
                   ReadManifest(where.root, where.job_id, name));
  uint64_t bytes_read = 0;
  ASSIGN_OR_RETURN(const auto tensors, ReadMasterTensors(where.root, manifest, &bytes_read));
  RETURN_IF_ERROR(WriteTensorDict(options.out, tensors));
  uint64_t parameters = 0;
  for (const auto& [tensor_name, t] : tensors) parameters += static_cast<uint64_t>(t.numel());
  return absl::StrFormat(
      "exported checkpoint %s/%s (step %u) to %s: %d tensors, %u parameters (fp32 masters), %s "
      "read\n",
      manifest.job_id(), manifest.name(), manifest.state().committed_step(), options.out,
      tensors.size(), parameters, FormatBytes(static_cast<double>(bytes_read)));
}

}  // namespace zeroshard::tools
