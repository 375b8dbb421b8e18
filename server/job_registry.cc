#include "server/job_registry.h"

#include "absl/strings/str_cat.h"

namespace zeroshard {

absl::StatusOr<std::shared_ptr<Job>> JobRegistry::Find(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job \"", id.substr(0, 140),
                                            "\" is not registered on this daemon ",
                                            "(RegisterJob first)"));
  }
  return it->second;
}

std::shared_ptr<Job> JobRegistry::Insert(std::shared_ptr<Job> job, bool* inserted) {
  absl::MutexLock lock(&mu_);
  auto [it, ok] = jobs_.emplace(job->config().id, job);
  *inserted = ok;
  return it->second;
}

bool JobRegistry::Contains(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  return jobs_.count(id) > 0;
}

void JobRegistry::Remove(const std::string& id) {
  std::shared_ptr<Job> doomed;  // destroyed outside the lock
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return;
  doomed = std::move(it->second);
  jobs_.erase(it);
}

std::vector<std::shared_ptr<Job>> JobRegistry::All() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Job>> out;
  for (const auto& [id, job] : jobs_) out.push_back(job);
  return out;
}

size_t JobRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return jobs_.size();
}

}  // namespace zeroshard
