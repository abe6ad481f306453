#include "common/logging.h"

#include <cctype>
#include <cstdio>
#include <mutex>

#include "common/env.h"

namespace rr {

namespace {
LogLevel parse_level() {
  std::string s = env_str("RINGREDUCE_LOG_LEVEL", "warning");
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "error") return LogLevel::kError;
  if (s == "info") return LogLevel::kInfo;
  if (s == "debug") return LogLevel::kDebug;
  return LogLevel::kWarning;
}
const char* level_name(LogLevel l) {
  switch (l) {
    case LogLevel::kError: return "ERROR";
    case LogLevel::kWarning: return "WARNING";
    case LogLevel::kInfo: return "INFO";
    case LogLevel::kDebug: return "DEBUG";
  }
  return "?";
}
}  // namespace

bool log_enabled(LogLevel level) {
  // Read once per process; the level is a constant of the launch, not state.
  static const LogLevel threshold = parse_level();
  return level <= threshold;
}

void log_line(LogLevel level, int rank, const std::string& msg) {
  std::fprintf(stderr, "[ringreduce %s rank %d] %s\n", level_name(level), rank, msg.c_str());
  std::fflush(stderr);
}

}  // namespace rr
