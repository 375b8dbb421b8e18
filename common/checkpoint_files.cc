#include "common/checkpoint_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <functional>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/status_macros.h"
#include "common/job_id.h"
#include "common/job_spec.h"
#include "common/protocol.h"

namespace zeroshard {
namespace {

constexpr uint64_t kWritePieceBytes = 8ull << 20;
// The longest identity (or owner digest) a job's checkpoint directory notes.
constexpr size_t kMaxJobNoteBytes = 1024;

}  // namespace

absl::Status FileError(int err, absl::string_view what, absl::string_view path) {
  const std::string msg = absl::StrCat("checkpoint: ", what, " ", path, ": ", std::strerror(err));
  switch (err) {
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
      return absl::ResourceExhaustedError(
          absl::StrCat(msg, " (the checkpoint directory is full; earlier checkpoints are intact)"));
    case ENOENT:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(msg);
    case ELOOP:
      return absl::FailedPreconditionError(
          absl::StrCat(msg, " (a symbolic link: checkpoint files are not opened through links)"));
    default:
      return absl::InternalError(msg);
  }
}

namespace {

// Closes the descriptor on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// 16 hex digits from the kernel's random source: a name nobody can guess.
absl::StatusOr<std::string> RandomHex() {
  uint64_t r = 0;
  for (size_t got = 0; got < sizeof(r);) {
    const ssize_t n = ::getrandom(reinterpret_cast<char*>(&r) + got, sizeof(r) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return FileError(errno, "getrandom for a temporary name in", "the checkpoint directory");
    }
    got += static_cast<size_t>(n);
  }
  return absl::StrCat(absl::Hex(r, absl::kZeroPad16));
}

bool TrustedOwner(uid_t uid) { return uid == ::geteuid() || uid == 0; }

// OK iff the directory `st` (at `path`) can hold this daemon's files: owned
// by the daemon's effective user or root, and writable by nobody else
// unless sticky (where others cannot replace what the daemon made).
absl::Status CheckTrustedDirectory(const struct stat& st, const std::string& path) {
  if (!TrustedOwner(st.st_uid)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint: ", path, " is owned by uid ", st.st_uid, ", not by this daemon's user (uid ",
        ::geteuid(), ") or root: another user could replace its files; chown ", ::geteuid(), " ",
        path, ", or use a directory this user owns"));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint: ", path, " is writable by group or others (mode ",
        absl::StrFormat("%04o", st.st_mode & 07777),
        ") without the sticky bit: chmod go-w ", path));
  }
  return absl::OkStatus();
}

absl::Status CheckTrustedDirectory(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return FileError(errno, "checking directory", path);
  return CheckTrustedDirectory(st, path);
}

// Writes n bytes at p to fd, whose file offset is `offset`.
absl::Status WriteAll(int fd, const char* p, uint64_t n, uint64_t offset, const std::string& path,
                      std::atomic<uint64_t>* progress) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<uint64_t>(n, kWritePieceBytes));
    if (w < 0) {
      if (errno == EINTR) continue;
      return FileError(errno, "writing", path);
    }
    if (w == 0) return FileError(ENOSPC, "writing", path);
    // Start the disk on these pages now, so it works while the next piece
    // is copied (the final fsync then waits for little).
    ::sync_file_range(fd, static_cast<off_t>(offset), w, SYNC_FILE_RANGE_WRITE);
    offset += static_cast<uint64_t>(w);
    p += w;
    n -= static_cast<uint64_t>(w);
    if (progress != nullptr) progress->fetch_add(static_cast<uint64_t>(w));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteFileAtomically(
    const std::string& dir, const std::string& name,
    const std::function<absl::Status(int fd, const std::string& tmp_path)>& produce) {
  Fd d;
  d.fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d.fd < 0) return FileError(errno, "opening directory", dir);
  // Host and pid say whose a leftover is; the random part makes the name
  // one nobody can plant a link at in advance (O_EXCL | O_NOFOLLOW refuse
  // whatever is there anyway).
  char host[64] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::string tmp_name;
  Fd f;
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<std::string> random = RandomHex();
    if (!random.ok()) return random.status();
    tmp_name = absl::StrCat(".", name, ".tmp.", host, ".", ::getpid(), ".", *random);
    f.fd = ::openat(d.fd, tmp_name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                    0600);
    if (f.fd >= 0) break;
    if (errno != EEXIST || attempt == 3) {
      return FileError(errno, "creating", absl::StrCat(dir, "/", tmp_name));
    }
  }
  const std::string tmp = absl::StrCat(dir, "/", tmp_name);
  absl::Status s = produce(f.fd, tmp);
  if (s.ok() && ::fsync(f.fd) != 0) s = FileError(errno, "syncing", tmp);
  if (s.ok()) {
    const int fd = f.fd;
    f.fd = -1;
    if (::close(fd) != 0) s = FileError(errno, "closing", tmp);
  }
  // Replaces whatever is at `name`, a link included, without following it.
  if (s.ok() && ::renameat(d.fd, tmp_name.c_str(), d.fd, name.c_str()) != 0) {
    s = FileError(errno, "renaming", tmp);
  }
  if (!s.ok()) {
    ::unlinkat(d.fd, tmp_name.c_str(), 0);
    return s;
  }
  if (::fsync(d.fd) != 0) return FileError(errno, "syncing directory", dir);
  return absl::OkStatus();
}

namespace {

bool ParseStepOrder(const v1::CheckpointManifest& a, const v1::CheckpointManifest& b) {
  if (a.state().committed_step() != b.state().committed_step()) {
    return a.state().committed_step() < b.state().committed_step();
  }
  if (a.completed_unix_ms() != b.completed_unix_ms()) {
    return a.completed_unix_ms() < b.completed_unix_ms();
  }
  return a.name() < b.name();
}

}  // namespace

absl::Status ValidateCheckpointName(absl::string_view name, bool allow_latest) {
  if (name == kLatestCheckpoint) {
    if (allow_latest) return absl::OkStatus();
    return absl::InvalidArgumentError(
        "name: \"latest\" is reserved (loads read it as the newest complete checkpoint)");
  }
  // The job id rule is the same character set and length.
  if (!IsValidJobId(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("name: must be ", kCheckpointNameRule, ", got \"", absl::CEscape(name), "\""));
  }
  return absl::OkStatus();
}

std::string CheckpointJobDir(absl::string_view root, absl::string_view job_id) {
  return absl::StrCat(root, "/", job_id);
}

std::string CheckpointDir(absl::string_view root, absl::string_view job_id,
                          absl::string_view name) {
  return absl::StrCat(root, "/", job_id, "/", name);
}

std::string CheckpointPartDir(absl::string_view root, absl::string_view job_id,
                              absl::string_view name, uint32_t daemon_index) {
  return absl::StrCat(CheckpointDir(root, job_id, name), "/part-", daemon_index);
}

absl::Status MakeDirectories(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("checkpoint: empty directory name");
  constexpr int kOpenDir = O_RDONLY | O_DIRECTORY | O_CLOEXEC;
  Fd dir;
  dir.fd = ::open(path[0] == '/' ? "/" : ".", kOpenDir);
  if (dir.fd < 0) return FileError(errno, "opening directory", path[0] == '/' ? "/" : ".");
  // Each component relative to its parent's descriptor, so that what is
  // checked is what is created into.
  for (size_t begin = 0; begin < path.size();) {
    if (path[begin] == '/') {
      ++begin;
      continue;
    }
    size_t end = path.find('/', begin);
    if (end == std::string::npos) end = path.size();
    const std::string name = path.substr(begin, end - begin);
    const std::string prefix = path.substr(0, end);
    std::string parent = path.substr(0, begin);
    while (parent.size() > 1 && parent.back() == '/') parent.pop_back();
    if (parent.empty()) parent = ".";
    // Every directory on the way, existing or made here: whoever may
    // replace one may replace everything below it.
    if (absl::Status s = CheckTrustedDirectory(dir.fd, parent); !s.ok()) return s;
    Fd next;
    next.fd = ::openat(dir.fd, name.c_str(), kOpenDir | O_NOFOLLOW);
    if (next.fd < 0 && errno == ENOENT) {
      if (::mkdirat(dir.fd, name.c_str(), 0700) != 0 && errno != EEXIST) {
        return FileError(errno, "creating directory", prefix);
      }
      next.fd = ::openat(dir.fd, name.c_str(), kOpenDir | O_NOFOLLOW);
    }
    if (next.fd < 0 && (errno == ELOOP || errno == ENOTDIR)) {
      struct stat st;
      if (::fstatat(dir.fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
        return FileError(errno, "creating directory", prefix);
      }
      if (S_ISLNK(st.st_mode)) {
        // Followed only when nobody but this user or root can have placed
        // it: owned by one of them, in a directory only they can change.
        if (!TrustedOwner(st.st_uid)) {
          return absl::FailedPreconditionError(absl::StrCat(
              "checkpoint: ", prefix, " is a symbolic link owned by uid ", st.st_uid,
              ", not by this daemon's user (uid ", ::geteuid(),
              ") or root: not followed; remove it or name the real directory"));
        }
        if (absl::Status s = CheckTrustedDirectory(dir.fd, parent); !s.ok()) return s;
        next.fd = ::openat(dir.fd, name.c_str(), kOpenDir);
      } else {
        errno = ENOTDIR;
      }
    }
    if (next.fd < 0) {
      if (errno == ENOTDIR) {
        return absl::FailedPreconditionError(
            absl::StrCat("checkpoint: ", prefix, " exists and is not a directory"));
      }
      return FileError(errno, "creating directory", prefix);
    }
    std::swap(dir.fd, next.fd);
    begin = end;
  }
  return CheckTrustedDirectory(dir.fd, path);
}

absl::Status SyncDirectory(const std::string& dir) {
  Fd f;
  f.fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (f.fd < 0) return FileError(errno, "opening directory", dir);
  if (::fsync(f.fd) != 0) return FileError(errno, "syncing directory", dir);
  return absl::OkStatus();
}

absl::Status WriteArrayFile(const std::string& dir, const std::string& name, const void* data,
                            uint64_t bytes, std::atomic<uint64_t>* progress,
                            v1::CheckpointFile* out) {
  return WriteArrayFileFrom(dir, name, bytes, progress, out,
                            [&](ArraySink sink) { return sink(data, bytes); });
}

absl::Status WriteArrayFileFrom(const std::string& dir, const std::string& name, uint64_t bytes,
                                std::atomic<uint64_t>* progress, v1::CheckpointFile* out,
                                absl::FunctionRef<absl::Status(ArraySink)> source) {
  out->Clear();
  out->set_name(name);
  out->set_bytes(bytes);
  out->set_block_bytes(kCheckpointBlockBytes);
  return WriteFileAtomically(dir, name, [&](int fd, const std::string& tmp) -> absl::Status {
    uint64_t off = 0;       // bytes written so far
    uint32_t whole = 0;     // CRC-32C of the finished blocks
    uint32_t block = 0;     // of the block being filled
    uint64_t in_block = 0;  // its bytes so far
    auto finish_block = [&] {
      out->add_block_crc32c(block);
      whole = Crc32cCombine(whole, block, in_block);
      block = 0;
      in_block = 0;
    };
    const absl::Status produced = source([&](const void* data, uint64_t n) -> absl::Status {
      if (n > bytes - off) {
        return absl::InternalError(absl::StrCat("checkpoint: ", name, ": more than ", bytes,
                                                " bytes produced"));
      }
      const char* p = static_cast<const char*>(data);
      for (uint64_t done = 0; done < n;) {
        // One pass over the bytes: the block's CRC; the file's follows from it.
        const uint64_t k = std::min(n - done, kCheckpointBlockBytes - in_block);
        block = Crc32cCombine(block, Crc32c(p + done, k), k);
        in_block += k;
        RETURN_IF_ERROR(WriteAll(fd, p + done, k, off, tmp, progress));
        off += k;
        done += k;
        if (in_block == kCheckpointBlockBytes) finish_block();
      }
      return absl::OkStatus();
    });
    RETURN_IF_ERROR(produced);
    if (off != bytes) {
      return absl::InternalError(absl::StrCat("checkpoint: ", name, ": ", off, " of ", bytes,
                                              " bytes produced"));
    }
    if (in_block > 0) finish_block();
    out->set_crc32c(whole);
    return absl::OkStatus();
  });
}

absl::Status WriteProtoFile(const std::string& dir, const std::string& name,
                            const google::protobuf::Message& message) {
  std::string bytes;
  if (!message.SerializeToString(&bytes)) {
    return absl::InternalError(absl::StrCat("checkpoint: cannot serialise ", name));
  }
  return WriteFileAtomically(dir, name, [&](int fd, const std::string& tmp) {
    return WriteAll(fd, bytes.data(), bytes.size(), 0, tmp, nullptr);
  });
}

absl::Status ReadProtoFile(const std::string& path, google::protobuf::Message* message) {
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (f.fd < 0) return FileError(errno, "opening", path);
  struct stat st;
  if (::fstat(f.fd, &st) != 0) return FileError(errno, "reading", path);
  if (static_cast<uint64_t>(st.st_size) > kMaxManifestFileBytes) {
    return absl::DataLossError(absl::StrCat("checkpoint: ", path, " has ", st.st_size,
                                            " bytes, more than a manifest can be (",
                                            kMaxManifestFileBytes, ")"));
  }
  std::string bytes;
  char buf[1 << 16];
  for (;;) {
    const ssize_t r = ::read(f.fd, buf, sizeof(buf));
    if (r < 0) {
      if (errno == EINTR) continue;
      return FileError(errno, "reading", path);
    }
    if (r == 0) break;
    bytes.append(buf, static_cast<size_t>(r));
    if (bytes.size() > kMaxManifestFileBytes) {
      return absl::DataLossError(absl::StrCat("checkpoint: ", path, " is larger than a manifest can be"));
    }
  }
  if (!message->ParseFromString(bytes)) {
    return absl::DataLossError(absl::StrCat("checkpoint: ", path, " does not parse as a ",
                                            message->GetTypeName()));
  }
  return absl::OkStatus();
}

std::vector<std::string> ArrayFilesOf(const v1::JobSpec& spec) {
  if (spec.optimizer().kind() == v1::OPTIMIZER_KIND_SGD_MOMENTUM) {
    return {kMasterFile, kExpAvgFile};
  }
  return {kMasterFile, kExpAvgFile, kExpAvgSqFile};
}

absl::Status CheckManifest(const v1::CheckpointManifest& m) {
  auto bad = [&](auto... what) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", m.job_id(), "/", m.name(), ": MANIFEST ", what...));
  };
  if (m.format_version() != kCheckpointFormatVersion) {
    return bad("has format version ", m.format_version(), "; this build reads ",
               kCheckpointFormatVersion);
  }
  // Every length below is bounded by the spec's layout (at most
  // Layout::kMaxElements elements), so no product or sum of them overflows.
  const uint64_t total = m.partition_map().total_elements();
  absl::StatusOr<Layout> layout = LayoutFromProto(m.spec().layout());
  if (!layout.ok()) return bad("spec: ", layout.status().message());
  if (total != layout->total_elements()) {
    return bad("partition_map.total_elements is ", total, ", the spec's layout has ",
               layout->total_elements());
  }
  const std::vector<std::string> files = ArrayFilesOf(m.spec());
  uint64_t next = 0;
  for (int i = 0; i < m.parts_size(); ++i) {
    const v1::PartManifest& p = m.parts(i);
    if (p.daemon_index() != static_cast<uint32_t>(i) ||
        p.daemon_count() != static_cast<uint32_t>(m.parts_size())) {
      return bad("lists part ", i, " as daemon ", p.daemon_index(), " of ", p.daemon_count());
    }
    if (p.range().begin() != next || p.range().end() < p.range().begin() ||
        p.range().end() > total) {
      return bad("part ", i, " covers [", p.range().begin(), ", ", p.range().end(),
                 "), expected to start at ", next, " inside [0, ", total, ")");
    }
    next = p.range().end();
    if (p.state().committed_step() != m.state().committed_step()) {
      return bad("part ", i, " is at step ", p.state().committed_step(), ", the checkpoint at ",
                 m.state().committed_step());
    }
    if (p.files_size() != static_cast<int>(files.size())) {
      return bad("part ", i, " has ", p.files_size(), " files, the optimizer needs ",
                 files.size());
    }
    const uint64_t bytes = (p.range().end() - p.range().begin()) * sizeof(float);
    for (int f = 0; f < p.files_size(); ++f) {
      const v1::CheckpointFile& file = p.files(f);
      if (file.block_bytes() == 0 || file.block_bytes() > kMaxCheckpointBlockBytes) {
        return bad("part ", i, " file ", f, " (", file.name(), ") has block_bytes ",
                   file.block_bytes(), ", outside 1..", kMaxCheckpointBlockBytes);
      }
      const uint64_t blocks =
          file.bytes() / file.block_bytes() + (file.bytes() % file.block_bytes() != 0 ? 1 : 0);
      if (file.name() != files[f] || file.bytes() != bytes ||
          static_cast<uint64_t>(file.block_crc32c_size()) != blocks) {
        return bad("part ", i, " file ", f, " (", file.name(), ", ", file.bytes(),
                   " bytes) does not match its range");
      }
    }
  }
  if (m.parts_size() == 0 || next != total) {
    return bad("parts cover [0, ", next, ") of [0, ", total, ")");
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::CheckpointManifest> ReadManifest(absl::string_view root,
                                                    absl::string_view job_id,
                                                    absl::string_view name) {
  if (absl::Status s = ValidateCheckpointName(name, false); !s.ok()) return s;
  const std::string dir = CheckpointDir(root, job_id, name);
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", job_id, "/", name,
                                            ": no such checkpoint in ", root));
  }
  v1::CheckpointManifest m;
  absl::Status s = ReadProtoFile(absl::StrCat(dir, "/", kManifestFile), &m);
  if (absl::IsNotFound(s)) {
    // Incomplete: say which parts are there.
    std::vector<std::string> written, missing;
    uint32_t count = 0;
    std::map<uint32_t, uint64_t> parts;  // daemon index -> step
    std::unique_ptr<DIR, int (*)(DIR*)> entries(::opendir(dir.c_str()), ::closedir);
    while (entries != nullptr) {
      const dirent* e = ::readdir(entries.get());
      if (e == nullptr) break;
      uint32_t d = 0;
      if (!absl::SimpleAtoi(absl::StripPrefix(e->d_name, "part-"), &d) ||
          !absl::StartsWith(e->d_name, "part-")) {
        continue;
      }
      v1::PartManifest part;
      if (ReadProtoFile(absl::StrCat(dir, "/", e->d_name, "/", kPartManifestFile), &part).ok()) {
        parts[d] = part.state().committed_step();
        count = std::max(count, part.daemon_count());
      }
    }
    for (const auto& [d, step] : parts) {
      written.push_back(absl::StrCat("part-", d, " (step ", step, ")"));
    }
    // `count` comes from the PART files: list a bounded number, count the rest.
    uint32_t d = 0;
    for (; d < count && missing.size() < static_cast<size_t>(kMaxMissingReported); ++d) {
      if (parts.count(d) == 0) missing.push_back(absl::StrCat("part-", d));
    }
    uint64_t unlisted = count - d;
    for (auto it = parts.lower_bound(d); it != parts.end() && it->first < count; ++it) --unlisted;
    if (unlisted != 0) missing.push_back(absl::StrCat("and ", unlisted, " more"));
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", job_id, "/", name, " is incomplete (no ", kManifestFile,
        "): written: ", written.empty() ? "none" : absl::StrJoin(written, ", "),
        "; missing: ", missing.empty() ? "the manifest" : absl::StrJoin(missing, ", "),
        count != 0 ? absl::StrCat(" (", count, " daemons wrote this job)") : ""));
  }
  if (!s.ok()) return s;
  if (m.job_id() != job_id || m.name() != name) {
    return absl::DataLossError(absl::StrCat("checkpoint ", job_id, "/", name, ": ", kManifestFile,
                                            " names ", m.job_id(), "/", m.name()));
  }
  if (absl::Status c = CheckManifest(m); !c.ok()) return c;
  return m;
}

namespace {

// One short line in the job's checkpoint directory: its text without the
// surrounding white space; empty when the file does not exist.
absl::StatusOr<std::string> ReadJobNote(absl::string_view root, absl::string_view job_id,
                                        absl::string_view file) {
  const std::string path = absl::StrCat(CheckpointJobDir(root, job_id), "/", file);
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return std::string();
    return FileError(errno, "opening", path);
  }
  char buf[kMaxJobNoteBytes + 2];
  const ssize_t n = ::read(fd, buf, sizeof(buf));
  const int err = errno;
  ::close(fd);
  if (n < 0) return FileError(err, "reading", path);
  return std::string(absl::StripAsciiWhitespace(absl::string_view(buf, static_cast<size_t>(n))));
}

absl::Status WriteJobNote(absl::string_view root, absl::string_view job_id, absl::string_view file,
                          absl::string_view value) {
  const std::string dir = CheckpointJobDir(root, job_id);
  if (absl::Status s = MakeDirectories(dir); !s.ok()) return s;
  const std::string text = absl::StrCat(value, "\n");
  return WriteFileAtomically(dir, std::string(file),
                             [&](int fd, const std::string& tmp) -> absl::Status {
                               if (::write(fd, text.data(), text.size()) !=
                                   static_cast<ssize_t>(text.size())) {
                                 return FileError(errno, "writing", tmp);
                               }
                               return absl::OkStatus();
                             });
}

// Bytes of the regular files under `dir` (not following symbolic links);
// a name that vanishes meanwhile counts nothing.
absl::StatusOr<uint64_t> TreeBytes(const std::string& dir, int depth) {
  std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(dir.c_str()), ::closedir);
  if (d == nullptr) {
    if (errno == ENOENT) return 0;
    return FileError(errno, "listing", dir);
  }
  uint64_t total = 0;
  while (const dirent* e = ::readdir(d.get())) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    const std::string path = absl::StrCat(dir, "/", name);
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) continue;
    if (S_ISREG(st.st_mode)) {
      total += static_cast<uint64_t>(st.st_size);
    } else if (S_ISDIR(st.st_mode) && depth > 0) {
      absl::StatusOr<uint64_t> below = TreeBytes(path, depth - 1);
      if (!below.ok()) return below.status();
      total += *below;
    }
  }
  return total;
}

}  // namespace

absl::StatusOr<std::string> ReadCheckpointOwner(absl::string_view root,
                                                absl::string_view job_id) {
  return ReadJobNote(root, job_id, kCheckpointOwnerFile);
}

absl::Status WriteCheckpointOwner(absl::string_view root, absl::string_view job_id,
                                  absl::string_view digest_hex) {
  return WriteJobNote(root, job_id, kCheckpointOwnerFile, digest_hex);
}

absl::StatusOr<std::string> ReadCheckpointIdentity(absl::string_view root,
                                                   absl::string_view job_id) {
  return ReadJobNote(root, job_id, kCheckpointIdentityFile);
}

absl::Status WriteCheckpointIdentity(absl::string_view root, absl::string_view job_id,
                                     absl::string_view identity) {
  if (identity.empty() || identity.size() > kMaxJobNoteBytes ||
      absl::StrContains(identity, '\n')) {
    return absl::InvalidArgumentError(
        absl::StrCat("identity: 1..", kMaxJobNoteBytes, " bytes on one line"));
  }
  return WriteJobNote(root, job_id, kCheckpointIdentityFile, identity);
}

absl::StatusOr<uint64_t> CheckpointBytesOfIdentity(absl::string_view root,
                                                   absl::string_view identity) {
  const std::string top(root);
  std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(top.c_str()), ::closedir);
  if (d == nullptr) {
    if (errno == ENOENT) return 0;
    return FileError(errno, "listing", top);
  }
  uint64_t total = 0;
  while (const dirent* e = ::readdir(d.get())) {
    const std::string job_id = e->d_name;
    if (!IsValidJobId(job_id)) continue;
    absl::StatusOr<std::string> recorded = ReadCheckpointIdentity(root, job_id);
    if (!recorded.ok() || *recorded != identity) continue;
    // A job directory holds checkpoints, each of parts: three levels.
    absl::StatusOr<uint64_t> bytes = TreeBytes(CheckpointJobDir(root, job_id), 3);
    if (!bytes.ok()) return bytes.status();
    total += *bytes;
  }
  return total;
}

absl::StatusOr<std::vector<v1::CheckpointManifest>> ListCompleteCheckpoints(
    absl::string_view root, absl::string_view job_id) {
  std::vector<v1::CheckpointManifest> out;
  const std::string dir = CheckpointJobDir(root, job_id);
  std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(dir.c_str()), ::closedir);
  if (d == nullptr) {
    if (errno == ENOENT) return out;
    return FileError(errno, "listing", dir);
  }
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d.get())) {
    const std::string n = e->d_name;
    if (ValidateCheckpointName(n, false).ok()) names.push_back(n);
  }
  for (const std::string& n : names) {
    struct stat st;
    if (::stat(absl::StrCat(CheckpointDir(root, job_id, n), "/", kManifestFile).c_str(), &st) != 0) {
      continue;  // incomplete, or not a checkpoint
    }
    absl::StatusOr<v1::CheckpointManifest> m = ReadManifest(root, job_id, n);
    if (!m.ok()) return m.status();
    out.push_back(*std::move(m));
  }
  std::sort(out.begin(), out.end(), ParseStepOrder);
  return out;
}

absl::StatusOr<std::vector<PendingPart>> ListPendingParts(absl::string_view root,
                                                          absl::string_view job_id) {
  std::vector<PendingPart> out;
  const std::string dir = CheckpointJobDir(root, job_id);
  std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(dir.c_str()), ::closedir);
  if (d == nullptr) {
    if (errno == ENOENT) return out;
    return FileError(errno, "listing", dir);
  }
  // Idle checkpoints by step, the highest first.
  std::vector<std::pair<uint64_t, std::string>> names;
  while (const dirent* e = ::readdir(d.get())) {
    const std::string n = e->d_name;
    uint64_t step = 0;
    if (ValidateCheckpointName(n, false).ok() && absl::StartsWith(n, kIdleCheckpointPrefix) &&
        absl::SimpleAtoi(absl::string_view(n).substr(sizeof(kIdleCheckpointPrefix) - 1), &step)) {
      names.emplace_back(step, n);
    }
  }
  std::sort(names.rbegin(), names.rend());
  for (const auto& [step, n] : names) {
    if (out.size() >= kMaxPendingParts) break;
    const std::string checkpoint = CheckpointDir(root, job_id, n);
    struct stat st;
    if (::stat(absl::StrCat(checkpoint, "/", kManifestFile).c_str(), &st) == 0) continue;
    std::unique_ptr<DIR, int (*)(DIR*)> parts(::opendir(checkpoint.c_str()), ::closedir);
    while (parts != nullptr && out.size() < kMaxPendingParts) {
      const dirent* e = ::readdir(parts.get());
      if (e == nullptr) break;
      uint32_t index = 0;
      if (!absl::StartsWith(e->d_name, "part-") ||
          !absl::SimpleAtoi(absl::StripPrefix(e->d_name, "part-"), &index)) {
        continue;
      }
      PendingPart pending;
      pending.name = n;
      // A part still being written has no PART file yet; one that does not
      // parse, or names another index, is not offered.
      if (ReadProtoFile(absl::StrCat(checkpoint, "/", e->d_name, "/", kPartManifestFile),
                        &pending.part)
              .ok() &&
          pending.part.daemon_index() == index) {
        out.push_back(std::move(pending));
      }
    }
  }
  return out;
}

absl::StatusOr<std::string> ResolveCheckpointName(absl::string_view root,
                                                  absl::string_view job_id,
                                                  absl::string_view name) {
  if (absl::Status s = ValidateCheckpointName(name, true); !s.ok()) return s;
  if (name != kLatestCheckpoint) return std::string(name);
  absl::StatusOr<std::vector<v1::CheckpointManifest>> all = ListCompleteCheckpoints(root, job_id);
  if (!all.ok()) return all.status();
  if (all->empty()) {
    return absl::NotFoundError(
        absl::StrCat("job ", job_id, ": no complete checkpoint in ", root));
  }
  return all->back().name();
}

// ---- CheckpointReader ----

CheckpointReader::CheckpointReader(std::string root, v1::CheckpointManifest manifest)
    : root_(std::move(root)), manifest_(std::move(manifest)) {}

std::string CheckpointReader::PartFilePath(uint32_t daemon_index, const std::string& file) const {
  return absl::StrCat(
      CheckpointPartDir(root_, manifest_.job_id(), manifest_.name(), daemon_index), "/", file);
}

namespace {
const v1::CheckpointFile* FindFile(const v1::PartManifest& part, const std::string& name) {
  for (const v1::CheckpointFile& f : part.files()) {
    if (f.name() == name) return &f;
  }
  return nullptr;
}

FlatRange RangeOf(const v1::PartManifest& p) { return {p.range().begin(), p.range().end()}; }

// DataLoss naming `path` and the field unless `file`, of the part covering
// `range`, has the size the range implies, the size fstat gives `fd`, a
// block size within the protocol's bound and one CRC-32C per block. A
// reader's manifest normally passed CheckManifest; this keeps every read
// bounded by the file whatever manifest the reader was given.
absl::Status CheckFileShape(int fd, const std::string& path, const v1::CheckpointFile& file,
                            const FlatRange& range) {
  auto bad = [&](auto... what) {
    return absl::DataLossError(absl::StrCat("checkpoint: ", path, ": ", what...));
  };
  if (range.end < range.begin || range.size() > file.bytes() / sizeof(float) ||
      range.size() * sizeof(float) != file.bytes()) {
    return bad("the manifest says bytes ", file.bytes(), " for elements [", range.begin, ", ",
               range.end, ")");
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) return FileError(errno, "reading", path);
  if (static_cast<uint64_t>(st.st_size) != file.bytes()) {
    return bad("has ", st.st_size, " bytes, the manifest says ", file.bytes());
  }
  if (file.block_bytes() == 0 || file.block_bytes() > kMaxCheckpointBlockBytes) {
    return bad("the manifest says block_bytes ", file.block_bytes(), ", outside 1..",
               kMaxCheckpointBlockBytes);
  }
  const uint64_t blocks =
      file.bytes() / file.block_bytes() + (file.bytes() % file.block_bytes() != 0 ? 1 : 0);
  if (static_cast<uint64_t>(file.block_crc32c_size()) != blocks) {
    return bad("the manifest lists ", file.block_crc32c_size(), " block CRC-32Cs for ", blocks,
               " blocks");
  }
  return absl::OkStatus();
}

// Reads block b of `file` (open as fd) whole into buf and checks it against
// its CRC-32C; adds the bytes read to *bytes_read (may be null).
absl::Status ReadCheckedBlock(int fd, const std::string& path, const v1::CheckpointFile& file,
                              uint64_t b, char* buf, uint64_t* bytes_read) {
  const uint64_t off = b * file.block_bytes();
  const uint64_t n = std::min<uint64_t>(file.block_bytes(), file.bytes() - off);
  for (uint64_t got = 0; got < n;) {
    const ssize_t r = ::pread(fd, buf + got, n - got, static_cast<off_t>(off + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return FileError(errno, "reading", path);
    }
    if (r == 0) {
      return absl::DataLossError(absl::StrCat("checkpoint: ", path, " ends at byte ", off + got,
                                              ", the manifest says ", file.bytes()));
    }
    got += static_cast<uint64_t>(r);
  }
  if (bytes_read != nullptr) *bytes_read += n;
  if (Crc32c(buf, n) != file.block_crc32c(static_cast<int>(b))) {
    return absl::DataLossError(absl::StrCat("checkpoint: ", path, " block ", b, " (bytes ", off,
                                            "..", off + n,
                                            ") does not match its CRC-32C: the file is corrupted"));
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status CheckpointReader::CheckReadable(const FlatRange& range,
                                             const std::vector<std::string>& files) const {
  std::vector<std::string> problems;
  for (const v1::PartManifest& p : manifest_.parts()) {
    if (RangeOf(p).Intersect(range).empty()) continue;
    for (const std::string& name : files) {
      const v1::CheckpointFile* f = FindFile(p, name);
      const std::string path = PartFilePath(p.daemon_index(), name);
      struct stat st;
      if (f == nullptr) {
        problems.push_back(absl::StrCat(path, " (not in the manifest)"));
      } else if (::stat(path.c_str(), &st) != 0) {
        problems.push_back(absl::StrCat(path, " (missing)"));
      } else if (static_cast<uint64_t>(st.st_size) != f->bytes()) {
        problems.push_back(
            absl::StrCat(path, " (", st.st_size, " bytes, the manifest says ", f->bytes(), ")"));
      }
    }
  }
  if (problems.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint ", manifest_.job_id(), "/", manifest_.name(),
      ": part files this daemon needs are not readable here: ", absl::StrJoin(problems, ", "),
      " (loading under another partitioning reads other daemons' parts: use a shared "
      "--checkpoint_dir or copy the parts)"));
}

absl::Status CheckpointReader::ReadRange(const std::string& file, const FlatRange& range,
                                         float* dst, uint64_t* bytes_read) const {
  std::vector<char> block;
  for (const v1::PartManifest& p : manifest_.parts()) {
    const FlatRange part = RangeOf(p);
    const FlatRange piece = part.Intersect(range);
    if (piece.empty()) continue;
    const v1::CheckpointFile* f = FindFile(p, file);
    const std::string path = PartFilePath(p.daemon_index(), file);
    if (f == nullptr) {
      return absl::DataLossError(absl::StrCat("checkpoint: ", path, " is not in the manifest"));
    }
    Fd fd;
    fd.fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd.fd < 0) return FileError(errno, "opening", path);
    if (absl::Status st = CheckFileShape(fd.fd, path, *f, part); !st.ok()) return st;
    const uint64_t first = (piece.begin - part.begin) * sizeof(float);
    const uint64_t last = (piece.end - part.begin) * sizeof(float);
    const uint64_t bb = f->block_bytes();
    block.resize(bb);
    for (uint64_t b = first / bb; b * bb < last; ++b) {
      const uint64_t off = b * bb;
      const uint64_t n = std::min(bb, f->bytes() - off);
      if (absl::Status st = ReadCheckedBlock(fd.fd, path, *f, b, block.data(), bytes_read);
          !st.ok()) {
        return st;
      }
      const uint64_t from = std::max(first, off);
      const uint64_t to = std::min(last, off + n);
      // `from` is a whole element past part.begin, and at or past range.begin.
      const uint64_t element = part.begin + from / sizeof(float);
      std::memcpy(dst + (element - range.begin), block.data() + (from - off), to - from);
    }
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::VerifyPart(uint32_t daemon_index, uint64_t* bytes_read) const {
  if (daemon_index >= static_cast<uint32_t>(manifest_.parts_size())) {
    return absl::InvalidArgumentError(absl::StrCat("part ", daemon_index, ": the checkpoint has ",
                                                   manifest_.parts_size(), " parts"));
  }
  const v1::PartManifest& p = manifest_.parts(static_cast<int>(daemon_index));
  std::vector<char> block;
  for (const v1::CheckpointFile& f : p.files()) {
    const std::string path = PartFilePath(daemon_index, f.name());
    Fd fd;
    fd.fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd.fd < 0) return FileError(errno, "opening", path);
    if (absl::Status st = CheckFileShape(fd.fd, path, f, RangeOf(p)); !st.ok()) return st;
    block.resize(f.block_bytes());
    uint32_t whole = 0;
    for (uint64_t off = 0, b = 0; off < f.bytes(); off += f.block_bytes(), ++b) {
      const uint64_t n = std::min<uint64_t>(f.block_bytes(), f.bytes() - off);
      if (absl::Status st = ReadCheckedBlock(fd.fd, path, f, b, block.data(), bytes_read);
          !st.ok()) {
        return st;
      }
      const uint32_t crc = f.block_crc32c(static_cast<int>(b));
      whole = Crc32cCombine(whole, crc, n);
    }
    if (whole != f.crc32c()) {
      return absl::DataLossError(
          absl::StrCat("checkpoint: ", path, " does not match its CRC-32C: the file is corrupted"));
    }
  }
  return absl::OkStatus();
}

}  // namespace zeroshard
