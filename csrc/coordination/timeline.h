// A Chrome-trace timeline (RINGREDUCE_TIMELINE=path.json, or start(path) /
// stop() at run time: Horovod's start_timeline/stop_timeline), written by rank 0
// only. Rank 0's engine always has one; it records nothing while no trace is
// open (active() is false, and callers skip building what they would record).
// The engine thread records; any thread may start or stop, so every member
// takes mutex_ (uncontended, except at the moment of a start or stop). One row per tensor; on it,
// nested activities:
//   NEGOTIATE_<OP>   from the first rank's request to readiness, with an
//                    instant mark "rank r ready" as each rank's request arrives
//   WAIT             ready, queued behind earlier responses
//   MEMCPY_IN_FUSION_BUFFER / MEMCPY_OUT_FUSION_BUFFER
//   <OP> with the algorithm's phases inside (AGREE, RING_REDUCE_SCATTER,
//        RING_ALLGATHER, DIRECT, BROADCAST_CHAIN, ...)
// With mark_cycles (Horovod's HOROVOD_TIMELINE_MARK_CYCLES), an instant
// event CYCLE_START across all rows marks the start of each negotiation round.
// Events are buffered and appended to the file after every round, so a trace
// of a crashed job is still readable (the viewer accepts a missing "]");
// stop() writes the closing bracket, making the file strict JSON.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/context.h"

namespace rr {

class Timeline : public PhaseObserver {
 public:
  Timeline() = default;
  ~Timeline() override;
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  void negotiate_begin(const std::string& tensor, const char* op);
  void rank_ready(const std::string& tensor, int rank);
  void negotiate_end(const std::string& tensor);
  void begin(const std::string& tensor, const std::string& activity);
  void end(const std::string& tensor);

  // The tensors the executing response covers: algorithm phases (reported by
  // the collectives through PhaseObserver) are drawn on their rows.
  void set_current(const std::vector<std::string>& tensors);
  void phase(const char* name) override;
  void phase_end();

  void flush();
  // Opens `path` (InvalidInputError naming it if it cannot be written), closing a
  // trace already open first.
  void start(const std::string& path, bool mark_cycles = false);
  void cycle_start();  // a CYCLE_START mark, if the trace marks cycles
  void stop();         // closes the trace as strict JSON; harmless when none is open
  bool active() const { return active_.load(std::memory_order_relaxed); }

 private:
  int row(const std::string& tensor);
  void event(const char* ph, int tid, const std::string& name);
  void phase_end_locked();
  void flush_locked();
  void stop_locked();

  std::mutex mutex_;
  std::atomic<bool> active_{false};
  std::FILE* file_ = nullptr;
  std::string buf_;
  std::unordered_map<std::string, int> rows_;
  std::vector<std::string> current_;
  bool in_phase_ = false;
  bool mark_cycles_ = false;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace rr
