// Status propagation helpers. Debian's Abseil (20220623) ships no public
// RETURN_IF_ERROR / ASSIGN_OR_RETURN, so draftfeed carries its own pair.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define DF_STATUS_CONCAT_INNER_(a, b) a##b
#define DF_STATUS_CONCAT_(a, b) DF_STATUS_CONCAT_INNER_(a, b)

#define DF_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status df_status_ = (expr);      \
    if (!df_status_.ok()) return df_status_; \
  } while (0)

#define DF_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return std::move(tmp).status();  \
  lhs = std::move(tmp).value()

#define DF_ASSIGN_OR_RETURN(lhs, expr) \
  DF_ASSIGN_OR_RETURN_IMPL_(DF_STATUS_CONCAT_(df_statusor_, __LINE__), lhs, expr)
