#pragma once

// RETURN_IF_ERROR / ASSIGN_OR_RETURN for absl::Status(Or) call chains.
//
//   RETURN_IF_ERROR(store.Apply(chunk));
//   RETURN_IF_ERROR(ParseX(s), "while reading partition ", i);  // adds context
//   ASSIGN_OR_RETURN(Layout layout, Layout::Create(specs));
//   ASSIGN_OR_RETURN(auto map, PartitionMap::Create(l, n), "world_size=", n);

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace zeroshard::internal {

// Returns `status` with ": <context>" appended to its message, same code.
inline absl::Status AddContext(const absl::Status& status) { return status; }

template <typename... Args>
absl::Status AddContext(const absl::Status& status, const Args&... context) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(status.message(), ": ", context...));
}

inline const absl::Status& ToStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& ToStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

}  // namespace zeroshard::internal

#define ZS_CONCAT_INNER_(a, b) a##b
#define ZS_CONCAT_(a, b) ZS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (a Status) is not OK, with
// optional context arguments appended to the message.
#define RETURN_IF_ERROR(expr, ...)                                          \
  do {                                                                      \
    const absl::Status zs_status_ = (expr);                                 \
    if (!zs_status_.ok())                                                   \
      return ::zeroshard::internal::AddContext(zs_status_ __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)

// `lhs = std::move(value)` of the StatusOr `expr`, or returns its status
// (with optional context) from the enclosing function.
#define ASSIGN_OR_RETURN(lhs, expr, ...) \
  ZS_ASSIGN_OR_RETURN_IMPL_(ZS_CONCAT_(zs_statusor_, __LINE__), lhs, expr, ##__VA_ARGS__)

#define ZS_ASSIGN_OR_RETURN_IMPL_(var, lhs, expr, ...)                      \
  auto var = (expr);                                                        \
  if (!var.ok())                                                            \
    return ::zeroshard::internal::AddContext(var.status() __VA_OPT__(, ) __VA_ARGS__); \
  lhs = std::move(var).value()
