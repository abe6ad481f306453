// Op execution behind one interface, so a device backend (NCCL on GPU
// buffers) plugs in without the coordination code knowing: the engine keeps
// a list of executors and hands each agreed response to the one that
// handles its device (every tensor of a response is on one device; fusion
// keys on it).
//
// `local[i]` is this rank's entry for response.tensors[i], or nullptr when
// this rank has joined and takes part with a neutral contribution. The
// executor fills the entries' results; the engine resolves their handles.
// Errors thrown by execute() propagate as rr::Error; the engine decides what
// they break (kInvalidArgument / kMismatch fail the response's entries).
//
// Synchronous executors (the CPU one) finish in execute() and return true.
// Asynchronous ones (the GPU one) enqueue the work and return false: the
// entries stay pending, and the engine, which calls poll() in its loop while
// busy() is true, completes them when poll() reports them. Such an executor
// rings the engine's waker (set_waker) when enqueued work may have finished,
// so the engine need not poll often to complete it promptly.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "coordination/completion_waker.h"
#include "coordination/handle.h"
#include "coordination/request.h"
#include "transport/context.h"

namespace rr {

class Timeline;

// One response an asynchronous executor has finished (or failed): the
// names of the entries this rank had in it (never the absent ones of a
// joined rank, whose names a later call may reuse).
struct Completion {
  std::vector<std::string> names;
  bool ok = true;
  ErrorKind kind = ErrorKind::kInternal;  // when !ok
  std::string message;                    // when !ok
};

class Executor {
 public:
  virtual ~Executor() = default;
  // True if this executor runs tensors on `device` (-1: host memory).
  virtual bool handles(int32_t device) const = 0;
  // True when done (the engine resolves the entries now); false when
  // enqueued (poll() reports it later).
  virtual bool execute(const Response& r, const std::vector<Entry*>& local) = 0;
  // Work enqueued by execute() that finished since the last call, in order.
  virtual std::vector<Completion> poll() { return {}; }
  // True while enqueued work has not been reported by poll().
  virtual bool busy() const { return false; }
  // Responses enqueued and not yet finished (as of the last poll()).
  virtual size_t in_flight() const { return 0; }
  // The job failed (Engine::fail_engine): stop enqueued work that may wait
  // for peers, so that nothing waiting on it (a framework's stream ordered
  // after it) waits forever. The engine fails the entries itself.
  virtual void abort(const std::string& /*why*/) {}
  // Rung (from any thread) when work enqueued since may have finished.
  virtual void set_waker(std::shared_ptr<CompletionWaker> /*waker*/) {}
};

// Host memory: tensor fusion through a persistent fusion buffer, collectives
// over the Context's shm / TCP links.
std::unique_ptr<Executor> make_cpu_executor(Context& ctx, Timeline* timeline);

// The executor for tensors on GPU `device`, made when the first response for
// it arrives (gpu/gpu_executor_factory.cc). Throws rr::Error naming what is
// missing (a CUDA build, a driver, a device, NCCL, a communicator).
std::unique_ptr<Executor> make_device_executor(Context& ctx, int32_t device);
// What a build without CUDA says wherever a GPU is asked of it.
extern const char* const kBuiltWithoutCuda;

// Fills `count` elements with the neutral element of `op` (0 for Sum and
// Average, 1 for Product, the largest value for Min, the lowest for Max).
void fill_identity(void* buf, size_t count, DType dtype, ReduceOp op);

}  // namespace rr
