// What the Python side holds while a collective is in flight. A handle covers
// one call: one tensor, or all members of a grouped_allreduce. It completes
// once every entry is resolved (success or failure), so buffers the caller
// keeps alive until then are never touched afterwards. The first failure
// wins and is what wait() raises.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/error.h"
#include "coordination/drive_token.h"
#include "coordination/request.h"

namespace rr {

// Tells the engine that some caller is blocked in HandleState::wait(), and
// wakes it from BatchWindow::hold(). Protocol (sequentially consistent, no
// lost wake-up): the sleeper reads seq, sets sleeping, re-checks waiting and
// closed and only then sleeps on seq; a caller increments waiting (close()
// sets closed), then seq, then wakes the futex (if sleeping is set).
// Shared by the engine and its handles, so a handle outliving its engine
// never touches freed memory.
class WaitSignal {
 public:
  bool waiting() const { return waiting_.load() > 0; }
  void begin_wait();
  void end_wait() { waiting_.fetch_sub(1); }
  // Sleeps until a caller begins to wait, close(), poke() or `timeout_ns`
  // passes; not at all when `unless` is set already (read after the sequence
  // number: a poke() after setting it is never lost).
  void sleep(int64_t timeout_ns, const std::atomic<bool>* unless = nullptr);
  // Ends the current sleep (the engine's device work finished).
  void poke();
  // Ends the current sleep and every later one (the engine is stopping).
  void close();
  bool closed() const { return closed_.load() != 0; }
  // Who runs the engine's rounds (drive_token.h); a waiting caller offers to.
  DriveToken& token() { return token_; }

 private:
  DriveToken token_;
  std::atomic<uint32_t> waiting_{0};
  std::atomic<uint32_t> seq_{0};
  std::atomic<uint32_t> sleeping_{0};
  std::atomic<uint32_t> closed_{0};
};

// A buffer the engine allocated for a result whose size only the
// collective decides (allgather, reducescatter, alltoall).
struct OwnedBuffer {
  std::shared_ptr<uint8_t> data;
  size_t bytes = 0;
  std::vector<int64_t> shape;
};
OwnedBuffer allocate_owned(const std::vector<int64_t>& shape, DType dtype);

class HandleState {
 public:
  HandleState(size_t entries, std::shared_ptr<WaitSignal> signal)
      : outputs(entries), signal_(std::move(signal)), remaining_(entries), unqueued_(entries) {}

  // Stream-ordered completion of GPU work (DDP's kind of wait: the host does
  // not block on the device). The GPU executor calls mark_enqueued once per
  // entry when that entry's work is on its stream, with a function that makes
  // another stream wait for that work (and all before it: one stream per
  // executor). Once every entry is enqueued, wait_enqueued_for returns true
  // and stream_waiter() is the last entry's function. A handle that fails or
  // completes first is simply done.
  // `executor_stream`: the stream the work runs on (a framework may record
  // its tensors' use there: torch's Tensor.record_stream).
  using StreamWaiter = std::function<void(void* stream)>;
  void mark_enqueued(StreamWaiter waiter, void* executor_stream);
  // Blocks (telling the engine, like wait()) until done or every entry is
  // enqueued, at most `timeout_ns`; true then. Does not throw.
  bool wait_enqueued_for(int64_t timeout_ns);
  StreamWaiter stream_waiter() const;
  void* executor_stream() const;  // nullptr until every entry is enqueued

  void resolve_one();
  void fail_one(ErrorKind kind, const std::string& message);
  // Resolves one entry of each handle in `hs` (a grouped call's handle
  // appears once per entry), marking every handle that completes before
  // waking any caller: a caller synchronizing a response's handles in turn
  // then finds the rest done instead of sleeping on each, which cost one
  // cross-core wake-up per tensor (~3.4 us each, 161 gradients: 0.55 ms).
  static void resolve_all(const std::vector<std::shared_ptr<HandleState>>& hs);
  bool done() const { return done_.load(std::memory_order_acquire); }
  // Blocks until done (telling the engine, through the WaitSignal, that
  // this caller waits); throws the failure if any. While the engine is idle
  // the caller first runs the rounds itself (engine_drive.cc). It does not poll first:
  // measured, polling gained nothing here, and a polling caller competes for
  // a core with the engine threads doing the work (2 ranks x 2 threads on
  // 2 cores).
  void wait();
  // Waits at most `timeout_ns` (telling the engine, like wait()); true once
  // done. Does not throw: rethrow() does, once done.
  bool wait_for(int64_t timeout_ns);
  // Once done(): throws the failure if any (what wait() would throw).
  void rethrow() const;

  std::vector<OwnedBuffer> outputs;      // by entry, for engine-allocated results
  std::vector<int64_t> received_splits;  // alltoall
  int join_result = -1;                  // join

 private:
  // Counts one entry done; true when that completed the handle (the caller
  // then notifies cv_, after releasing mu_).
  bool finish_locked();
  // finish_locked(), then, if that completed the handle, unlock and notify.
  void finish_and_notify(std::unique_lock<std::mutex>& lock);
  std::shared_ptr<WaitSignal> signal_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  size_t remaining_;
  size_t unqueued_;  // entries not yet enqueued on a GPU stream
  StreamWaiter waiter_;
  void* executor_stream_ = nullptr;
  bool failed_ = false;
  ErrorKind kind_ = ErrorKind::kInternal;
  std::string message_;
};

// One tensor this rank submitted.
struct Entry {
  RequestMeta meta;
  const void* in = nullptr;
  void* out = nullptr;          // allreduce / broadcast: the caller's result buffer
  std::vector<int64_t> splits;  // alltoall
  // GPU allgather / alltoall: the rows coming from each rank, which the
  // caller learnt before submitting (it allocates the output).
  std::vector<int64_t> peer_rows;
  bool join = false;  // a join() marker rather than a tensor
  // join(): this rank's GPU, on which it takes part in GPU collectives while
  // joined if it has no GPU executor yet (-1: none known).
  int32_t join_device = -1;
  // GPU tensors (meta.device >= 0): the stream that produced `in` (the
  // framework's current stream at submit time; nullptr: the default stream)
  // and, if the submitter recorded one there, the event marking the point
  // the collective must wait for. The GPU executor makes its own stream wait
  // on `gpu_ready_event`, or on an event it records on `gpu_stream` if none.
  void* gpu_stream = nullptr;
  void* gpu_ready_event = nullptr;
  std::shared_ptr<HandleState> handle;
  size_t index = 0;  // which of the handle's entries
};

}  // namespace rr
