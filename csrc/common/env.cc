#include "common/env.h"

#include <cstdlib>

#include "common/error.h"

namespace rr {

std::string env_str(const char* name, const std::string& dflt) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::string(v) : dflt;
}

int64_t env_int(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 10);
  if (*end != '\0') throw_error(ErrorKind::kInvalidArgument, name, "='", v, "' is not an integer");
  return x;
}

double env_double(const char* name, double dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  double x = std::strtod(v, &end);
  if (*end != '\0') throw_error(ErrorKind::kInvalidArgument, name, "='", v, "' is not a number");
  return x;
}

}  // namespace rr
