// Minimal leveled logging to stderr, prefixed with the rank. The level comes
// from RINGREDUCE_LOG_LEVEL (error, warning, info, debug; default warning).
#pragma once

#include <string>

#include "common/error.h"

namespace rr {

enum class LogLevel { kError = 0, kWarning = 1, kInfo = 2, kDebug = 3 };

bool log_enabled(LogLevel level);
void log_line(LogLevel level, int rank, const std::string& msg);

template <typename... Args>
void log(LogLevel level, int rank, const Args&... args) {
  if (log_enabled(level)) log_line(level, rank, cat(args...));
}

}  // namespace rr
