// A key-value store that ranks use to find each other before any peer-to-peer
// connection exists: each rank publishes its address under a key and reads the
// others'. Keys are write-mostly and never deleted; get() blocks until a key
// appears, which is what lets ranks that start at different times meet.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "common/error.h"

namespace rr {

class Store {
 public:
  virtual ~Store() = default;

  // Publishes value under key; a later set of the same key replaces it.
  virtual void set(const std::string& key, const std::string& value) = 0;

  // Blocks until key exists and returns its value. Throws kTimeout naming the
  // key if it does not appear within timeout_s (>= 0; inf waits forever). For a
  // remote store the timeout includes the round trip, so a timeout shorter than
  // one round trip fails even for a key that exists.
  virtual std::string get(const std::string& key, double timeout_s) = 0;

  // Publishes value under key unless the key exists; returns what the key
  // holds afterwards (value itself when this call was first). Atomic, so
  // claims cannot both win (the rendezvous refuses a second job this way).
  virtual std::string add(const std::string& key, const std::string& value) = 0;
};

// Turns a caller's timeout into an absolute deadline. Infinite timeouts are
// capped at ~3 years so the time_point arithmetic cannot overflow.
inline std::chrono::steady_clock::time_point deadline_after(double timeout_s) {
  if (std::isnan(timeout_s) || timeout_s < 0) {
    throw_error(ErrorKind::kInvalidArgument, "timeout must be >= 0 seconds, got ", timeout_s);
  }
  const double capped = std::min(timeout_s, 1e8);
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
             std::chrono::duration<double>(capped));
}

// Seconds left until deadline, never negative.
inline double seconds_until(std::chrono::steady_clock::time_point deadline) {
  const double left =
      std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
  return left > 0 ? left : 0.0;
}

// Allgather over a store: rank r publishes `mine` under "<prefix>/<r>", then
// reads every other rank's key; the result is indexed by rank.
// Invariants: all ranks pass the same prefix and size; a prefix is used for
// one allgather only (keys are never deleted, so reusing a prefix would read
// the previous round's values). timeout_s bounds the whole call, not each get,
// and the kTimeout raised names the first rank that had not published.
inline std::vector<std::string> store_allgather(Store& s, const std::string& prefix, int rank,
                                                int size, const std::string& mine,
                                                double timeout_s) {
  if (size <= 0 || rank < 0 || rank >= size) {
    throw_error(ErrorKind::kInvalidArgument, "store_allgather: rank ", rank,
                " is not in [0, size) for size ", size);
  }
  const auto deadline = deadline_after(timeout_s);
  s.set(prefix + "/" + std::to_string(rank), mine);
  std::vector<std::string> all(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    all[r] = (r == rank) ? mine : s.get(prefix + "/" + std::to_string(r), seconds_until(deadline));
  }
  return all;
}

}  // namespace rr
