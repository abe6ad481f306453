// The progress engine: drives a batch of sends and receives over any mix of
// links until all complete. It spins for a short while (a peer on the other
// core usually answers within microseconds), then blocks as the pending
// links' transports say (transports.h): on this rank's doorbell when only
// doorbell links are pending, on poll() when only fd links are, and in short
// poll slices when both are. Between blocking slices
// it checks deadlines and peer liveness, so a dead peer turns
// into an error naming that peer and the operation instead of a hang.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "transport/link.h"

namespace rr {

class Doorbell;
class Heartbeat;

struct SendOp {
  Link* link;
  const uint8_t* data;
  size_t n;
  size_t done = 0;
};

struct RecvOp {
  Link* link;
  RecvSink* sink;
  size_t n;
  size_t done = 0;
};

struct ProgressSettings {
  int rank = 0;
  double spin_seconds = 50e-6;           // RINGREDUCE_SPIN_US
  double timeout_seconds = 1800;         // RINGREDUCE_TIMEOUT_SECONDS
  Doorbell* doorbell = nullptr;          // this rank's, when it has shm links
  const Heartbeat* heartbeat = nullptr;  // checked between waits: a frozen peer fails
  // Set by Context::interrupt (this rank is shutting down): a wait that has moved
  // nothing for a second ends with an error instead of lasting until a frozen peer's
  // heartbeat times out.
  const std::atomic<bool>* leaving = nullptr;
};

// A link direction that is still waiting for bytes to move.
struct PendingIo {
  Link* link;
  bool sending;
};

// Names the operation for error messages; only called when an error occurs,
// so the hot path of small messages formats no strings.
using Describe = std::function<std::string()>;

// Anything the driver can advance: a batch of transfers, a ring pipeline...
class ProgressTask {
 public:
  virtual ~ProgressTask() = default;
  // Moves whatever can move without blocking. Returns true if any bytes moved
  // and sets *pending to the number of unfinished operations (0 = done).
  virtual bool advance(size_t* pending) = 0;
  // The link directions the task is waiting on (for poll, liveness, errors).
  virtual void pending_io(std::vector<PendingIo>* out) const = 0;
};

// Advances `task` until done: spin, then block, checking liveness and the
// deadline between blocking slices. Errors are prefixed with the
// rank and `what`.
void drive(const ProgressSettings& settings, ProgressTask& task, const Describe& what);

// Runs until every op is complete (with wait_sends = false: until every
// receive is; sends are pushed as far as they go and can be continued by a
// later call). Ops on the same link and direction run strictly in list order.
// `what` names the operation for errors, e.g. "allreduce 'grad' (#12)".
// Throws rr::Error on peer loss or timeout.
void run_transfers(const ProgressSettings& settings, std::vector<SendOp>& sends,
                   std::vector<RecvOp>& recvs, const Describe& what, bool wait_sends = true);

}  // namespace rr
