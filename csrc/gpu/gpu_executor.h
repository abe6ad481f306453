// The executor for tensors on one GPU (plain C++: every CUDA / NCCL call goes
// through GpuOps, so tests drive it with FakeGpuOps). It never blocks the
// engine thread on the device: execute() enqueues a response's work on its own
// stream and returns; poll() reports what has finished.
//
// Allreduce of several tensors (one fused response):
//   1. the library stream waits for each tensor's producer (Entry's
//      gpu_ready_event, or an event recorded now on its gpu_stream; one wait
//      per distinct event / stream)
//   2. one pack launch into the fusion buffer (layout from plan_pack; a
//      joined rank's absent tensors get the op's neutral elements instead,
//      after the prescale: zeros, or one fill launch for Min / Max / Product)
//   3. prescale launch (skipped when 1.0)
//   4. the NCCL allreduce in place on the fusion buffer
//   5. postscale launch (skipped when 1.0); for Average without ncclAvg
//      (NCCL < 2.10, integer dtypes, or ranks that joined) NCCL sums and the
//      1 / contributors is folded into this factor
//   6. one unpack launch to the outputs, and an event recorded: its
//      completion completes the response (a watcher thread wakes the engine
//      then: completion_watcher.h); each handle is told how to make a caller's
//      stream wait for it (HandleState::mark_enqueued), for stream-ordered
//      waits.
// One tensor runs in place on its own buffers: no pack or unpack (a copy in
// -> out first only when a prescale must not touch the input).
// Broadcast runs NCCL's broadcast in -> out; reducescatter, NCCL's
// reducescatter (gpu_reducescatter.cc); allgather, NCCL's allgather, padded
// when the row counts differ (gpu_allgather.cc; a joined rank gives 0 rows);
// alltoall, grouped NCCL sends and receives (gpu_alltoall.cc), refused while
// a rank has joined, as on the host.
//
// Compression (RequestMeta::wire, float32 / float64 tensors as float16 /
// bfloat16; gpu_allreduce_compressed.cc): the fused path with casting pack
// and unpack launches into a fusion buffer of the wire dtype, the NCCL
// allreduce in that dtype, prescale folded into the pack and postscale (and
// Average's 1 / contributors) into the unpack. Even one tensor takes it.
//
// With RINGREDUCE_HIERARCHICAL_ALLREDUCE=1 on several hosts (of any rank
// counts; a process set's members on several hosts too), allreduces take the
// fused path with a hierarchical reduction in step 4
// (gpu_allreduce_hierarchical.cc).
//
// Communicators: one per set of ranks, the job's for ordinary responses and
// one per process set for a set's (gpu_comms.cc), each made by the bootstrap
// of gpu_bootstrap.h at the first response that needs it, on its members only.
//
// Errors: an event that reports a CUDA error, or an NCCL asynchronous error
// (checked on every poll while work is in flight), aborts the communicator,
// waits (bounded) for the work enqueued behind it to run, fails every response
// in flight with that message and every later response on this device; the
// engine then fails as a whole and tells every peer (Engine::poll_executors),
// whose NCCL calls might otherwise wait forever.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "coordination/executor.h"
#include "gpu/completion_watcher.h"
#include "gpu/gpu_ops.h"
#include "gpu/pack_plan.h"

namespace rr {
namespace gpu {

inline uint64_t addr_of(const void* p) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
}
// Elements per row of dim 0 (1 for a vector).
inline uint64_t row_elements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= static_cast<uint64_t>(shape[i]);
  return n;
}

struct GpuExecutorOptions {
  int device = 0;
  int rank = 0;  // in the job
  int size = 1;
  PackOptions pack;
  double drain_seconds = 10;  // fail_in_flight's bound on waiting for enqueued work
};

// The GpuOps of one more NCCL communicator on this GPU, among the ranks of
// `group` (a process set's view of the Context). Only its NCCL calls are used.
using CommOpsMaker = std::function<std::shared_ptr<GpuOps>(Context& group)>;

class GpuExecutor : public Executor {
 public:
  GpuExecutor(std::shared_ptr<GpuOps> ops, GpuExecutorOptions opt);
  ~GpuExecutor() override;
  GpuExecutor(const GpuExecutor&) = delete;
  GpuExecutor& operator=(const GpuExecutor&) = delete;

  // Joins the job's NCCL communicator now (every rank with the same 128-byte id).
  void init_comm(const std::string& unique_id);
  // Communicators made at their first response instead (gpu_comms.cc): the
  // job's over `ctx`, a process set's over ctx.group(members) with ops from
  // `make_ops`. `why_not`: why this rank cannot (then `ops` may be null).
  void bootstrap_over(Context& ctx, CommOpsMaker make_ops, std::string why_not);

  bool handles(int32_t device) const override { return device == opt_.device; }
  bool execute(const Response& r, const std::vector<Entry*>& local) override;
  std::vector<Completion> poll() override;
  bool busy() const override { return !in_flight_.empty() || !finished_.empty(); }
  size_t in_flight() const override { return in_flight_.size(); }
  void abort(const std::string& why) override;
  void set_waker(std::shared_ptr<CompletionWaker> waker) override;  // once, before any work

 private:
  // How an allreduce of `r` reduces: the NCCL op, and the factor applied
  // after it (the request's postscale, with 1 / contributors folded in when
  // Average runs as Sum).
  struct ReducePlan {
    DeviceOp op;
    double postscale;
  };
  ReducePlan plan_reduce(const Response& r) const;
  // One NCCL communicator: the job's (key: no members) or a process set's.
  struct Comm {
    std::shared_ptr<GpuOps> ops;  // its NCCL calls
    int rank = 0, size = 1;       // in the communicator
    bool alive = false;           // joined and not aborted
    std::string failed;           // why it could not be made (every later response fails)
  };
  Comm& comm_for(const Response& r) { return comm_of(r.tensors.front()); }
  Comm& comm_of(const RequestMeta& m);  // m.members' communicator (gpu_comms.cc)
  // gpu_allreduce_hierarchical.cc
  struct HostSplit {
    std::vector<std::vector<int>> hosts;  // global ranks per host, the set's members only
    int host = -1, local = 0;             // this rank's host and place there
    uint64_t units = 1;                   // lcm of the hosts' rank counts
  };
  HostSplit split_hosts(const RequestMeta& m) const;
  bool hierarchical(const Response& r, const std::vector<Entry*>& local) const;
  uint64_t hierarchical_bytes(const RequestMeta& m, uint64_t bytes, uint64_t item) const;
  void allreduce_hierarchical(const RequestMeta& m, DType dtype, uint64_t buf, uint64_t count,
                              DeviceOp op);
  void cross_host_rings(const HostSplit& s, const RequestMeta& m, DType dtype, uint64_t unit,
                        DeviceOp op);
  void wait_here(Comm& c);
  void abort_comms();
  GpuOps& nccl() { return *cur_->ops; }  // the current response's communicator

  struct InFlight {
    std::vector<std::string> names;
    GpuEvent done = nullptr;
    std::vector<GpuEvent> waits;  // events recorded on producer streams
    uint64_t ticket = 0;          // the watcher's, for `done` (0: not watched)
  };
  void start();
  void wait_for_producers(const std::vector<Entry*>& local, InFlight& f);
  void publish_enqueued(const std::vector<Entry*>& local, GpuEvent done);
  void allreduce_fused(const Response& r, const std::vector<Entry*>& local, bool hier);
  void allreduce_one(const Response& r, Entry* e);
  void broadcast_one(const Response& r, Entry* e);
  void reducescatter_one(const Response& r, Entry* e);  // gpu_reducescatter.cc
  // gpu_allreduce_compressed.cc: float16 / bfloat16 compression, joined ranks
  static void check_wire(const RequestMeta& m);
  void allreduce_compressed(const Response& r, const std::vector<Entry*>& local, bool hier);
  static std::pair<std::vector<uint64_t>, std::vector<uint64_t>> local_addresses(
      const std::vector<Entry*>& local);
  void fill_neutral(uint64_t addr, uint64_t count, DType dtype, ReduceOp op);
  void fill_absent(const Response& r, const std::vector<Entry*>& local, uint64_t buf,
                   const std::vector<uint64_t>& offsets, DType dtype);
  // gpu_allgather.cc; `joined`: a rank has joined (e is null on that rank)
  void allgather_one(const Response& r, Entry* e, bool joined);
  std::vector<int64_t> agree_rows(const RequestMeta& m, Entry* e);
  void alltoall_one(Entry* e);  // gpu_alltoall.cc
  uint64_t fusion(uint64_t bytes);
  GpuEvent take_event();
  void release(InFlight& f);
  void fail_in_flight(const std::string& why);
  void drain_in_flight();

  std::shared_ptr<GpuOps> ops_;  // streams, events, memory, kernels; the job's NCCL calls
  GpuExecutorOptions opt_;
  bool started_ = false;
  std::map<std::vector<int32_t>, Comm> comms_;
  Comm* cur_ = nullptr;
  Context* ctx_ = nullptr;  // set by bootstrap_over
  CommOpsMaker make_ops_;
  std::string why_not_;
  std::vector<uint8_t> staging_;  // hierarchical allreduce's host shard
  GpuStream stream_ = nullptr;
  uint64_t fusion_addr_ = 0, fusion_bytes_ = 0;
  std::vector<GpuEvent> free_events_;
  // Completed done-events the watcher has yet to pass, by ticket (in order):
  // free only once it has (CompletionWatcher::passed).
  std::deque<std::pair<uint64_t, GpuEvent>> watched_;
  std::vector<GpuEvent> all_events_;
  std::deque<InFlight> in_flight_;
  std::vector<Completion> finished_;
  std::string broken_;                          // set once the device or communicator failed
  std::unique_ptr<CompletionWatcher> watcher_;  // rings the engine's waker as work finishes
};

}  // namespace gpu
}  // namespace rr
