// Settings are environment variables named RINGREDUCE_*. Each is read where
// it is used, through these helpers, and documented in the README's table.
#pragma once

#include <cstdint>
#include <string>

namespace rr {

std::string env_str(const char* name, const std::string& dflt);
int64_t env_int(const char* name, int64_t dflt);   // throws kInvalidArgument on garbage
double env_double(const char* name, double dflt);  // throws kInvalidArgument on garbage

}  // namespace rr
