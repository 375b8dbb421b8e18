#pragma once

// The jobs a daemon serves, by id. Thread-safe. Jobs are shared_ptr so an
// RPC in flight keeps its job alive while the job is removed.

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/job.h"

namespace zeroshard {

class JobRegistry {
 public:
  // NotFound naming the job when it is not registered here.
  absl::StatusOr<std::shared_ptr<Job>> Find(const std::string& id) const;
  // Inserts `job` unless a job with its id exists: then returns the existing
  // one and leaves `job` unused (*inserted = false).
  std::shared_ptr<Job> Insert(std::shared_ptr<Job> job, bool* inserted);
  bool Contains(const std::string& id) const;
  void Remove(const std::string& id);
  std::vector<std::shared_ptr<Job>> All() const;
  size_t size() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard
