// The Engine: one background thread per rank that owns all communication.
// Callers enqueue entries (any thread) and get a HandleState back at once;
// the thread negotiates readiness with the other ranks (control.h protocol,
// Negotiator on rank 0), agrees responses through the response cache, and
// executes them through the executor for their device, completing handles.
//
// State machine of the thread:
//   IDLE  --local work (cycle time permitting) / control bytes arrive /
//           stall deadline (rank 0)-->  ROUND  --> EXECUTE --> IDLE
//   any   --peer lost, timeout, fatal stall-->  FAILED (every pending and
//           future call raises the error, naming the rank and operation)
//   any   --shutdown()-->  STOPPED (pending calls raise "shut down")
// IDLE spins for the spin time, then sleeps on the shm doorbell or poll(),
// waking every 100 ms to check that peers are alive (every 1 ms, polling the
// executors, while GPU work is in flight: handles of asynchronous executors
// resolve, and their names are released, only once poll() reports them). Local work waits in IDLE
// while the caller is still submitting (BatchWindow, batch_window.h).
// While the thread is idle, a caller blocked on its handle may run the rounds
// on its own thread instead (caller-driven rounds, engine_drive.cc): the
// driver token (drive_token.h) says who runs the state machine; fields marked
// "driver only" belong to whoever holds it.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "coordination/autotuner.h"
#include "coordination/batch_window.h"
#include "coordination/control.h"
#include "coordination/doorbell_watcher.h"
#include "coordination/executor.h"
#include "coordination/handle.h"
#include "coordination/negotiator.h"
#include "coordination/response_cache.h"
#include "coordination/timeline.h"
#include "transport/context.h"

namespace rr {

// RINGREDUCE_FOLD_BYTES unset: by the links to rank 0 (Engine::auto_fold_bytes).
constexpr size_t kFoldAuto = SIZE_MAX;

struct EngineOptions {
  uint64_t fusion_threshold = 256ULL << 20;  // RINGREDUCE_FUSION_THRESHOLD
  double cycle_time_s = 0;                   // RINGREDUCE_CYCLE_TIME_MS
  double batch_gap_s = 50e-6;                // RINGREDUCE_BATCH_US (batch_window.h)
  double batch_max_s = 2e-3;                 // RINGREDUCE_BATCH_MAX_US
  size_t cache_capacity = 1024;              // RINGREDUCE_CACHE_CAPACITY
  double stall_check_s = 60;                 // RINGREDUCE_STALL_CHECK_SECONDS
  double stall_shutdown_s = 0;               // RINGREDUCE_STALL_SHUTDOWN_SECONDS
  std::string timeline_path;                 // RINGREDUCE_TIMELINE (rank 0 writes it)
  bool timeline_mark_cycles = false;         // RINGREDUCE_TIMELINE_MARK_CYCLES
  bool fast_path = true;                     // RINGREDUCE_FAST_PATH (engine_drive.cc)
  size_t fold_bytes = kFoldAuto;             // RINGREDUCE_FOLD_BYTES (engine_fold.cc)
  bool paired_rounds = true;                 // RINGREDUCE_PAIRED_ROUNDS (engine_pair.cc)
  int gpu_queue_depth = 0;                   // RINGREDUCE_GPU_QUEUE_DEPTH (hold_for_device)
  AutotuneOptions autotune;                  // RINGREDUCE_AUTOTUNE* (autotuner.h)
  std::string thread_affinity;               // RINGREDUCE_THREAD_AFFINITY: a core per local rank
};

EngineOptions engine_options_from_env();

// What the engine thread has done so far (read from any thread): how often it
// negotiated, and how many responses and tensors it has begun to execute.
struct EngineStats {
  uint64_t rounds = 0;
  uint64_t responses = 0;
  uint64_t tensors = 0;
  uint64_t shared_allreduces = 0;        // over shared buffers (allreduce_shared.cc)
  uint64_t hierarchical_allreduces = 0;  // allreduce_hierarchical.cc
  uint64_t hierarchical_allgathers = 0;  // allgather_hierarchical.cc
  uint64_t adasum_allreduces = 0;        // collectives.h adasum(), any size
  uint64_t caller_rounds = 0;            // of `rounds`, run by a waiting caller (engine_drive.cc)
  uint64_t folded = 0;                   // of `responses`, finished in their round (engine_fold.cc)
  uint64_t paired = 0;                   // of `folded`, without a RESPONSES (engine_pair.cc)
  int64_t gpu_device = -1;               // the device of this rank's first GPU executor
  uint64_t device_holds = 0;             // GPU work held back while the device was behind
  // The settings in force: the autotuner's choice (autotuner.h) or the
  // configured ones; hierarchical: RINGREDUCE_HIERARCHICAL_ALLREDUCE's -1, 0, 1.
  bool autotuning = false;
  uint64_t autotune_trials = 0;
  uint64_t fusion_threshold = 0;
  double cycle_time_ms = 0;
  double batch_us = 0;
  int hierarchical = -1;
};

class Engine : private DriveToken::Driver {
 public:
  Engine(std::shared_ptr<Context> ctx, EngineOptions opt);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates locally (dtype/op, shape, root, duplicate names) and enqueues.
  // Unnamed entries get "noname.<n>". Throws if the engine failed.
  std::shared_ptr<HandleState> submit(std::vector<Entry> entries);
  // Horovod's join(): `members` names a process set (empty: the job); the
  // handle's join_result is the global rank that joined the set last.
  // `gpu_device`: this rank's GPU (see Entry::join_device; -1: none).
  std::shared_ptr<HandleState> join(const std::vector<int32_t>& members = {},
                                    int32_t gpu_device = -1);
  // The caller refused a call of `kind` under `name` ("" = the next unnamed
  // call's name) for `why` before submitting it (the Python layer's checks):
  // rank 0 hears of it, so the other ranks' matching calls fail naming this
  // rank and `why` instead of waiting for it (Negotiator::reject). submit()
  // does this itself for calls that fail its own checks. `members`: the
  // process set's ranks (empty: the global set), whose names are the set's
  // own (submit()), so that the set's other members fail the same way.
  void reject(CollKind kind, const std::string& name, const std::string& why,
              const std::vector<int32_t>& members = {});
  // Completed join()s; changes before the completing join's handle resolves.
  uint64_t join_epoch() const;
  // Horovod's start_timeline/stop_timeline: rank 0 writes the trace; elsewhere no-ops.
  void start_timeline(const std::string& path, bool mark_cycles = false);
  void stop_timeline();
  // A buffer every rank maps (Context::create_shared), from the calling
  // thread; refused once the engine has failed or stopped.
  std::shared_ptr<SharedRegion> create_shared(size_t bytes);
  // Stops the thread; calls still pending fail. Idempotent.
  void shutdown();
  EngineStats stats() const;
  Context& context() { return *ctx_; }
  // Makes the executor for a GPU the first time a response needs it; by
  // default make_device_executor (executor.h). Tests put a GPU executor over
  // FakeGpuOps here. Set it before submitting tensors for that GPU.
  using ExecutorFactory = std::function<std::unique_ptr<Executor>(int32_t device)>;
  void set_device_executor_factory(ExecutorFactory f);
  // How long the idle thread sleeps at most while device work is in flight
  // (it wakes at once when the work finishes: CompletionWaker). Tests lengthen it.
  void set_device_poll_seconds(double s) { device_poll_s_.store(s); }

 private:
  enum class Wake { kStop, kWork };
  struct Rejection {
    CollKind kind;
    std::string name;
    std::string why;
    std::vector<int32_t> members;  // of its process set; empty for the global set
  };
  std::string unnamed_locked(const std::vector<int32_t>& members);
  void reject_locked(const std::vector<Entry>& entries, const std::string& why);
  static RequestMeta rejected_meta(const Rejection& rj);
  void agree_on_settings();
  int affinity_core() const;  // RINGREDUCE_THREAD_AFFINITY's core for this rank, or -1
  size_t auto_fold_bytes() const;
  void validate(Entry& e);
  void validate_members(const RequestMeta& m) const;
  void enqueue_locked(std::vector<Entry>& entries, const std::shared_ptr<HandleState>& h);
  void notify();
  void loop();
  void run_round();
  Wake idle_wait();
  // Caller-driven rounds (engine_drive.cc).
  void drive(HandleState& h) override;
  void drive_rounds(HandleState& h);
  void hand_back(bool caller_waits);
  void wake_engine();
  void interrupt_after_grace();  // shutdown(): see engine.cc
  template <class F>
  void untokened(F&& f);
  void reclaim_token();
  void park();
  void withdraw_bell();
  bool bell_only() const;
  bool ready_to_start();
  void check_peers(double& last_check);
  std::string idle_state() const;
  void block(int64_t timeout_ns);
  void coordinator_round();
  bool receive_requests(uint64_t k, const std::vector<uint8_t>& promise);
  void worker_round();
  std::vector<Entry> drain();
  void release_names(const std::vector<std::string>& names);  // from in_flight_
  void record_local(std::vector<Entry>& fresh);
  std::vector<uint8_t> encode_requests(const std::vector<Entry>& fresh, bool join);
  void finish_join(const Response& r);
  bool joined(const std::vector<int32_t>& members) const;
  void decode_requests(int rank, const std::vector<uint8_t>& payload, double now);
  void decode_requests_from(int rank, const std::vector<uint8_t>& payload, double now);
  void submit_in_order(int rank, std::vector<RequestMeta> submitted,
                       const std::vector<Rejection>& refused, double t);
  std::vector<Response> decode_responses_from(const std::vector<uint8_t>& payload) const;
  std::vector<uint8_t> encode_responses(const std::vector<Response>& rs) const;
  std::vector<Response> decode_responses(const std::vector<uint8_t>& payload) const;
  void process(const std::vector<Response>& rs);
  // Folded rounds (engine_fold.cc).
  void encode_folds(const std::vector<Entry>& fresh, ByteWriter& w) const;
  void decode_folds(int rank, ByteReader& r);
  void fold_responses(std::vector<Response>& rs);
  void fold_one(Response& r);
  void finish_folded(const Response& r);
  bool folded_part_fits(const RequestMeta& m, int w, size_t bytes) const;
  void deliver_folded(const RequestMeta& m, Entry& e, const std::vector<uint8_t>& result);
  // Paired rounds and holds (engine_pair.cc).
  std::optional<RequestMeta> solo(const std::vector<uint8_t>& requests, int sender) const;
  bool solo_for(const std::vector<uint8_t>& requests, int sender,
                const std::vector<uint8_t>& promise) const;
  std::vector<uint8_t> promise_for(const std::vector<Entry>& fresh) const;
  void finish_paired_coordinator(const std::vector<Response>& rs);
  bool finish_paired_worker(const CtrlMessage& poll, const std::vector<uint8_t>& requests);
  bool arrived();
  std::unique_ptr<CtrlMessage> take_early(int peer);
  double hold_deadline() const;
  int64_t within_hold(int64_t timeout_ns) const;
  void execute(const Response& r);
  // The autotuner (engine_tune.cc).
  void make_tuner();
  void retune();
  void set_tuned(const Tunables& t);
  void tuned_stats(EngineStats& s) const;
  Executor& executor_for(const Response& r, int32_t device);
  bool async_busy() const;
  bool hold_for_device();
  void end_device_hold();
  void poll_executors();
  void resolve_names(const std::vector<std::string>& names);
  void fail_names(const std::vector<std::string>& names, ErrorKind kind, const std::string& msg);
  void fail_entries(const Response& r, ErrorKind kind, const std::string& msg);
  void fail_all(ErrorKind kind, const std::string& why);
  void fail_engine(const Error& e);
  double now() const;

  std::shared_ptr<Context> ctx_;
  EngineOptions opt_;
  const int rank_, size_;
  std::unique_ptr<Timeline> timeline_;
  std::unique_ptr<Negotiator> negotiator_;  // rank 0 only
  std::vector<int> workers_;                // rank 0: ranks 1 .. size - 1
  ResponseCache cache_;
  ControlChannel ctrl_;
  // By device (Executor::handles): the CPU executor first, GPU ones added
  // when a response first needs them. Engine thread only.
  std::vector<std::unique_ptr<Executor>> executors_;
  std::map<int32_t, std::string> unusable_;  // device -> why no executor could be made
  bool async_ = false;                       // some executor may complete later (poll)
  BatchWindow batch_;

  std::mutex shutdown_mu_;
  // Shared with submitting threads, under mu_.
  mutable std::mutex mu_;
  std::deque<Entry> queue_;
  std::vector<Rejection> rejected_;  // refused calls not yet told to rank 0
  ExecutorFactory device_factory_;
  std::unordered_set<std::string> in_flight_;
  uint64_t noname_ = 0;
  std::map<std::vector<int32_t>, uint64_t> noname_sets_;      // by process set
  std::map<std::vector<int32_t>, uint64_t> set_join_epochs_;  // completed join(process_set=)s
  uint64_t join_epoch_ = 0;  // completed join()s; with noname_, under mu_
  bool stopping_ = false;
  bool failed_ = false;
  ErrorKind fail_kind_ = ErrorKind::kPeerLost;
  std::string fail_message_;
  std::atomic<bool> has_work_{false};
  std::atomic<bool> stop_{false};
  std::atomic<bool> loop_exited_{false};   // the thread left loop(): shutdown() may join
  std::atomic<bool> polling_{false};       // the thread may be asleep in poll()
  std::atomic<bool> dead_{false};          // failed_, readable without mu_
  std::atomic<bool> gpu_seen_{false};      // a GPU tensor was submitted: no caller drives
  std::atomic<bool> host_queued_{false};   // queued work (or a refusal) not for a GPU
  std::atomic<uint64_t> device_holds_{0};  // holds begun (each sleeps in 1 ms slices)
  bool device_holding_ = false;            // engine thread: the last pass held for the device
  DriveToken& token_;                      // in batch_'s WaitSignal, shared with the handles
  std::atomic<uint64_t> caller_rounds_{0};
  std::atomic<uint64_t> folded_{0};
  std::atomic<uint64_t> paired_{0};
  bool bell_only_ = false;       // the thread sleeps on the doorbell alone
  bool engine_bell_ = false;     // driver only: the thread's doorbell announcement stands
  bool bell_withdrawn_ = false;  // driver only: a caller withdrew it (engine_drive.cc)

  // Driver only (the engine thread, or a caller holding the token).
  std::unordered_map<std::string, Entry> pending_;  // submitted, awaiting a response
  std::vector<Rejection> rejections_;               // drained, for this round
  // Names this rank refused whose error response has not come yet: that
  // response is about the refused call, not about a later call of the name
  // that this rank may already have made (fail_entries skips it once).
  std::unordered_multiset<std::string> refused_names_;
  std::vector<Entry> joins_;
  bool joined_ = false;
  int32_t join_device_ = -1;                       // driver only: the last join()'s gpu_device
  std::atomic<int32_t> gpu_device_{-1};            // EngineStats::gpu_device
  std::vector<std::vector<int32_t>> joined_sets_;  // join(process_set=)s not done yet
  // Rank 0: the workers' folded contributions, by tensor name (engine_fold.cc).
  struct Folds {
    std::vector<std::vector<uint8_t>> by_rank;
    std::vector<char> have;
    int count = 0;
  };
  std::unordered_map<std::string, Folds> folds_;
  // Messages read ahead of their round, by peer (engine_pair.cc): rank 0 keeps
  // workers' REQUESTS, a worker rank 0's POLL. holding_: some are kept; until
  // hold_until_ they may hold the round back.
  std::vector<std::unique_ptr<CtrlMessage>> early_;
  std::vector<std::string> early_solo_;  // rank 0: the one small call each announces, or ""
  bool holding_ = false;
  double hold_until_ = 0;
  uint64_t round_ = 0;
  std::atomic<uint64_t> executed_responses_{0};
  std::atomic<uint64_t> executed_tensors_{0};
  std::atomic<uint64_t> rounds_done_{0};
  double last_round_ = -1e9;
  int wake_fd_ = -1;
  // Rung by asynchronous executors when device work finishes (any thread):
  // sets device_done_ and wakes the thread. Disarmed by shutdown().
  std::shared_ptr<CompletionWaker> waker_;
  std::atomic<bool> device_done_{false};  // cleared by poll_executors()
  std::atomic<double> device_poll_s_{0.01};
  std::unique_ptr<DoorbellWatcher> watcher_;  // made on the first mixed shm + TCP sleep
  std::chrono::steady_clock::time_point t0_;
  // The autotuner (driver only) and what it chose, for stats() (any thread).
  std::unique_ptr<Autotuner> tuner_;
  int engine_core_ = -1;  // the engine thread's core (RINGREDUCE_THREAD_AFFINITY)
  bool hierarchical_tuned_ = false;
  std::atomic<double> cycle_s_{0};  // RINGREDUCE_CYCLE_TIME_MS, as tuned
  mutable std::mutex tune_mu_;
  Tunables tuned_;
  std::thread thread_;
};

}  // namespace rr
