#pragma once

// The on-disk form of checkpoints (proto/zeroshard/v1/checkpoint.proto
// describes the layout): atomic writes of data files and manifests, reading
// manifests back, finding complete checkpoints, and reading any flat range of
// a checkpoint's arrays from whichever parts hold it (what lets a job with
// another N_d or daemon count load it). Used by the daemon and by zsctl.
//
// Errors: InvalidArgument for a bad name; NotFound when a checkpoint does not
// exist; FailedPrecondition for an incomplete one (the message lists what is
// missing); DataLoss naming the file whose bytes or manifest do not check;
// ResourceExhausted when the disk is full (ENOSPC, EDQUOT, EFBIG);
// FailedPrecondition for a symbolic link where a checkpoint file should be
// (files are opened with O_NOFOLLOW); Internal for other I/O errors (with
// strerror). All functions block on disk I/O and
// take no locks; thread-compatible.

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/flat_range.h"
#include "google/protobuf/message.h"
#include "proto/zeroshard/v1/checkpoint.pb.h"

namespace zeroshard {

inline constexpr char kCheckpointNameRule[] =
    "1..128 bytes of [A-Za-z0-9._-], not \".\", \"..\" or \"latest\"";
inline constexpr char kLatestCheckpoint[] = "latest";
inline constexpr uint32_t kCheckpointFormatVersion = 1;
inline constexpr uint64_t kCheckpointBlockBytes = 4ull << 20;
// Largest MANIFEST or PART file read (checked against the file's size before
// reading): a manifest of the largest layout and daemon count fits.
inline constexpr uint64_t kMaxManifestFileBytes = 64ull << 20;

// The array files of a part, in the order they are written.
inline constexpr char kMasterFile[] = "master.f32";
inline constexpr char kExpAvgFile[] = "exp_avg.f32";
inline constexpr char kExpAvgSqFile[] = "exp_avg_sq.f32";
inline constexpr char kPartManifestFile[] = "PART";
inline constexpr char kManifestFile[] = "MANIFEST";

// In a job's checkpoint directory: the SHA-256 (hex) of the token of the job
// that first saved there. Not a checkpoint name ('@'), so never listed.
inline constexpr char kCheckpointOwnerFile[] = "owner@token.sha256";

// The owner digest (hex) of job_id's checkpoints under root; empty when no
// checkpoint of it was ever saved there. Errors: see the top.
absl::StatusOr<std::string> ReadCheckpointOwner(absl::string_view root, absl::string_view job_id);
// Writes it (creating the job's directory), atomically.
absl::Status WriteCheckpointOwner(absl::string_view root, absl::string_view job_id,
                                  absl::string_view digest_hex);

// In a job's checkpoint directory: the identity that registered the job
// that first saved there (server/rpc/services.h RegistrantOf), whose
// --max_checkpoint_bytes_per_identity the directory counts toward. Absent
// for the admin's jobs (exempt) and checkpoints saved before it existed.
inline constexpr char kCheckpointIdentityFile[] = "owner@identity";
// The identity recorded for job_id's checkpoints under root; empty when none
// is. Errors: see the top.
absl::StatusOr<std::string> ReadCheckpointIdentity(absl::string_view root,
                                                   absl::string_view job_id);
// Records it (creating the job's directory), atomically. InvalidArgument
// for an empty identity or one past 1 KiB.
absl::Status WriteCheckpointIdentity(absl::string_view root, absl::string_view job_id,
                                     absl::string_view identity);
// Bytes of the regular files in the checkpoint directories of the jobs
// whose recorded identity is `identity` (symbolic links are not followed).
// Blocks on a walk of root: for a save, not a hot path.
absl::StatusOr<uint64_t> CheckpointBytesOfIdentity(absl::string_view root,
                                                   absl::string_view identity);

// InvalidArgument ("name: ...") unless `name` follows kCheckpointNameRule.
// `allow_latest` admits "latest" (for loads).
absl::Status ValidateCheckpointName(absl::string_view name, bool allow_latest);

std::string CheckpointJobDir(absl::string_view root, absl::string_view job_id);
std::string CheckpointDir(absl::string_view root, absl::string_view job_id,
                          absl::string_view name);
std::string CheckpointPartDir(absl::string_view root, absl::string_view job_id,
                              absl::string_view name, uint32_t daemon_index);

// mkdir -p, new directories mode 0700. FailedPrecondition naming the
// directory (and the chown or chmod that fixes it) when `path`, or any
// directory on the way to it (from "/", or from the working directory for
// a relative path), is owned by neither the effective user nor root, or is
// writable by group or others without the sticky bit; also
// for a symbolic link on the way that such a user could have placed (owned
// by another user, or in such a directory): it is not followed.
absl::Status MakeDirectories(const std::string& path);
// fsync of a directory (makes renames in it durable).
absl::Status SyncDirectory(const std::string& dir);

// Writes dir/name atomically: `produce` writes the content to a descriptor
// of a temporary file in dir (its path given for messages), which is then
// fsynced and renamed, and dir fsynced. The file is mode 0600; the
// temporary name has a random part and is created with O_EXCL | O_NOFOLLOW,
// and the rename replaces a link at dir/name without following it. On any
// error the temporary file is removed and dir/name is untouched. I/O errors
// map as described above.
absl::Status WriteFileAtomically(
    const std::string& dir, const std::string& name,
    const std::function<absl::Status(int fd, const std::string& tmp_path)>& produce);
// The status of a failed system call on `path` (errno `err`): see the top.
absl::Status FileError(int err, absl::string_view what, absl::string_view path);

// Writes `bytes` bytes at `data` to dir/name atomically (a temporary name,
// fsync, rename, fsync of dir), computing the file's CRC-32C and one per
// kCheckpointBlockBytes block into *out. Adds the bytes written to *progress
// as it goes (may be null). On error the temporary file is removed and
// dir/name is untouched.
absl::Status WriteArrayFile(const std::string& dir, const std::string& name, const void* data,
                            uint64_t bytes, std::atomic<uint64_t>* progress,
                            v1::CheckpointFile* out);
// What WriteArrayFileFrom's source hands each piece of the file to, in
// order; an error from it ends the source.
using ArraySink = absl::FunctionRef<absl::Status(const void* data, uint64_t bytes)>;
// WriteArrayFile of bytes a source produces piece by piece (of any sizes)
// instead of one buffer: `source` calls the sink with consecutive pieces of
// `bytes` bytes in all. Internal when the pieces do not add up to `bytes`;
// the source's error otherwise, with the file untouched as above.
absl::Status WriteArrayFileFrom(const std::string& dir, const std::string& name, uint64_t bytes,
                                std::atomic<uint64_t>* progress, v1::CheckpointFile* out,
                                absl::FunctionRef<absl::Status(ArraySink)> source);
// Writes a binary protobuf to dir/name atomically, as above.
absl::Status WriteProtoFile(const std::string& dir, const std::string& name,
                            const google::protobuf::Message& message);
// Reads a binary protobuf: NotFound when absent, DataLoss when it does not parse.
absl::Status ReadProtoFile(const std::string& path, google::protobuf::Message* message);

// A complete checkpoint's manifest. NotFound when there is nothing of that
// name; FailedPrecondition for an incomplete one (listing the parts that
// are and are not written); DataLoss for a manifest that does not check
// (CheckManifest) or is larger than kMaxManifestFileBytes.
absl::StatusOr<v1::CheckpointManifest> ReadManifest(absl::string_view root,
                                                    absl::string_view job_id,
                                                    absl::string_view name);
// The complete checkpoints of a job, ascending by (step, completion time).
// Directories without a MANIFEST are skipped; one with a manifest that does
// not parse or check is DataLoss.
absl::StatusOr<std::vector<v1::CheckpointManifest>> ListCompleteCheckpoints(
    absl::string_view root, absl::string_view job_id);
// The checkpoints a daemon saves of a job it removes as idle are named this
// and the committed step (--job_idle_timeout_seconds).
inline constexpr char kIdleCheckpointPrefix[] = "idle-step-";
// A part on disk of such a checkpoint without a MANIFEST (no client was
// there to complete it): CompleteCheckpoint with every daemon's part makes
// it complete.
struct PendingPart {
  std::string name;
  v1::PartManifest part;
};
// At most this many pending parts are listed per job.
inline constexpr size_t kMaxPendingParts = 64;
// The parts written (PART file present) of a job's idle checkpoints
// (kIdleCheckpointPrefix) that have no MANIFEST, the highest step first; at
// most kMaxPendingParts.
absl::StatusOr<std::vector<PendingPart>> ListPendingParts(absl::string_view root,
                                                          absl::string_view job_id);
// `name`, or for "latest" the complete checkpoint with the highest step
// (NotFound when there is none).
absl::StatusOr<std::string> ResolveCheckpointName(absl::string_view root,
                                                  absl::string_view job_id,
                                                  absl::string_view name);
// OK iff the manifest is self-consistent: partition_map.total_elements that
// of the spec's layout, one part per daemon of the writer, their ranges
// tiling [0, total_elements), each with the array files its optimizer needs,
// sized to its range, with block_bytes in 1..kMaxCheckpointBlockBytes and one
// CRC-32C per block, steps agreeing. DataLoss naming the part, file and field
// otherwise. A manifest that passes bounds every length a reader allocates
// by: no arithmetic on its fields overflows.
absl::Status CheckManifest(const v1::CheckpointManifest& manifest);
// The array files a part holds for `spec`'s optimizer.
std::vector<std::string> ArrayFilesOf(const v1::JobSpec& spec);

// Reads ranges of a complete checkpoint's arrays, re-slicing parts as needed.
class CheckpointReader {
 public:
  CheckpointReader(std::string root, v1::CheckpointManifest manifest);

  const v1::CheckpointManifest& manifest() const { return manifest_; }

  // FailedPrecondition listing every part file that `range`'s read of
  // `files` needs and that is missing or has the wrong size in this
  // directory (a checkpoint written on other hosts' local disks: copy the
  // parts here, or use a shared --checkpoint_dir).
  absl::Status CheckReadable(const FlatRange& range, const std::vector<std::string>& files) const;
  // Reads flat elements `range` (inside [0, total_elements)) of array `file`
  // into dst (range.size() floats). Every block read is checked against its
  // CRC-32C: DataLoss naming the file and block on a mismatch.
  absl::Status ReadRange(const std::string& file, const FlatRange& range, float* dst,
                         uint64_t* bytes_read) const;
  // Reads every file of part `daemon_index` whole and checks each file's
  // CRC-32C and every block's: DataLoss naming the first file that fails.
  absl::Status VerifyPart(uint32_t daemon_index, uint64_t* bytes_read) const;

 private:
  std::string PartFilePath(uint32_t daemon_index, const std::string& file) const;

  const std::string root_;
  const v1::CheckpointManifest manifest_;
};

}  // namespace zeroshard
