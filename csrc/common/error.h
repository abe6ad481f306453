// One exception hierarchy for the core. Every error carries enough context for
// a user to act: which rank, which peer, which tensor, which operation.
// The bindings map each kind to a Python subclass of ringreduce.RingReduceError.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace rr {

enum class ErrorKind {
  kInvalidArgument,  // bad input from the caller on this rank
  kMismatch,         // ranks disagree about a collective (dtype, shape, op, root...)
  kPeerLost,         // a peer died, closed its connection or stopped responding
  kTimeout,          // a deadline passed with the peer still alive
  kInternal,         // a broken invariant or a failed system call
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

// Builds a message from stream pieces: throw_error(kPeerLost, "rank ", r, " lost").
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <typename... Args>
[[noreturn]] void throw_error(ErrorKind kind, const Args&... args) {
  throw Error(kind, cat(args...));
}

// errno text for system-call failures.
std::string errno_string(int err);

}  // namespace rr

#define RR_CHECK(cond, ...)                                                  \
  do {                                                                       \
    if (!(cond)) ::rr::throw_error(::rr::ErrorKind::kInternal, __VA_ARGS__); \
  } while (0)
