#include "gpu/gpu_executor.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <thread>

#include "common/error.h"

namespace rr {
namespace gpu {
namespace {

bool is_floating(DType t) {
  return t == DType::kFloat16 || t == DType::kBFloat16 || t == DType::kFloat32 ||
         t == DType::kFloat64;
}

std::vector<std::string> present_names(const Response& r, const std::vector<Entry*>& local) {
  std::vector<std::string> names;
  for (size_t i = 0; i < local.size(); ++i)
    if (local[i]) names.push_back(r.tensors[i].name);
  return names;
}

}  // namespace

GpuExecutor::GpuExecutor(std::shared_ptr<GpuOps> ops, GpuExecutorOptions opt)
    : ops_(std::move(ops)), opt_(opt) {}

GpuExecutor::~GpuExecutor() {
  // Work still in flight at shutdown may be an NCCL collective waiting for a
  // peer that is gone (the engine failed its entries): abort the communicator
  // first, which ends it. Then the stream is destroyed: that waits for work
  // still enqueued, so nothing below is in use.
  try {
    if (!in_flight_.empty()) abort_comms();
    if (started_) ops_->stream_destroy(stream_);
    // Its thread may still wait on an event (a device that never drains): then
    // the events stay, rather than be destroyed under that wait.
    const bool watcher_gone = !watcher_ || watcher_->stop(1.0);
    if (watcher_gone)
      for (GpuEvent e : all_events_) ops_->event_destroy(e);
    if (fusion_addr_) ops_->free_device(fusion_addr_, nullptr);
  } catch (const Error&) {  // a broken device: nothing left to release
  }
}

void GpuExecutor::set_waker(std::shared_ptr<CompletionWaker> waker) {
  watcher_ = waker ? std::make_unique<CompletionWatcher>(ops_, std::move(waker)) : nullptr;
}

void GpuExecutor::start() {
  if (started_) return;
  ops_->set_device(opt_.device);
  stream_ = ops_->stream_create();
  started_ = true;
}

void GpuExecutor::init_comm(const std::string& unique_id) {
  start();
  ops_->nccl_comm_init(unique_id, opt_.size, opt_.rank);
  Comm& c = comms_[{}];
  c.ops = ops_;
  c.rank = opt_.rank;
  c.size = opt_.size;
  c.alive = true;
}

void GpuExecutor::abort_comms() {
  for (auto& kv : comms_) {
    if (!kv.second.alive) continue;
    kv.second.alive = false;
    kv.second.ops->nccl_abort();
  }
}

GpuExecutor::ReducePlan GpuExecutor::plan_reduce(const Response& r) const {
  const RequestMeta& m = r.tensors.front();
  const int size = cur_->size;
  const int contributors = r.contributors > 0 ? r.contributors : size;
  switch (m.op) {
    case ReduceOp::kSum: return {DeviceOp::kSum, m.postscale};
    case ReduceOp::kMin: return {DeviceOp::kMin, m.postscale};
    case ReduceOp::kMax: return {DeviceOp::kMax, m.postscale};
    case ReduceOp::kProduct: return {DeviceOp::kProd, m.postscale};
    case ReduceOp::kAverage: break;
    case ReduceOp::kAdasum: break;  // host memory only: Engine::validate refuses it
  }
  if (contributors == size && is_floating(m.dtype) && cur_->ops->nccl_version() >= kNcclAvgVersion)
    return {DeviceOp::kAvg, m.postscale};
  return {DeviceOp::kSum, m.postscale / contributors};
}

bool GpuExecutor::execute(const Response& r, const std::vector<Entry*>& local) {
  const RequestMeta& m = r.tensors.front();
  const char* what = coll_name(m.kind);
  // Refusals come before anything is enqueued, alike on every rank.
  if (m.kind == CollKind::kBarrier)
    throw_error(ErrorKind::kInvalidArgument, what, " '", m.name, "': a barrier on GPU ",
                opt_.device, " (barriers run on the host)");
  const bool absent = std::any_of(local.begin(), local.end(), [](Entry* e) { return !e; });
  const bool joined = absent || (r.contributors > 0 && r.contributors < m.set_size(opt_.size));
  if (joined && m.kind == CollKind::kAlltoall)  // as on the host (the negotiator refuses it)
    throw_error(ErrorKind::kInvalidArgument, what, " '", m.name, "': tensors on GPU ", opt_.device,
                ": an alltoall cannot run while a rank has joined (only allreduce, allgather "
                "and broadcast can)");
  check_wire(m);
  if (!broken_.empty()) {
    Completion c;
    c.names = present_names(r, local);
    c.ok = false;
    c.message = broken_;
    finished_.push_back(std::move(c));
    return false;
  }
  cur_ = &comm_for(r);
  start();
  InFlight f;
  f.names = present_names(r, local);
  wait_for_producers(local, f);
  try {  // a refusal inside: nothing was enqueued but the waits, whose events come back
    if (m.kind == CollKind::kBroadcast)
      broadcast_one(r, local[0]);
    else if (m.kind == CollKind::kReducescatter)
      reducescatter_one(r, local[0]);
    else if (m.kind == CollKind::kAllgather)
      allgather_one(r, local[0], joined);
    else if (m.kind == CollKind::kAlltoall)
      alltoall_one(local[0]);
    else if (m.wire >= 0)
      allreduce_compressed(r, local, hierarchical(r, local));
    else if (r.tensors.size() == 1 && !hierarchical(r, local))
      allreduce_one(r, local[0]);
    else
      allreduce_fused(r, local, hierarchical(r, local));
  } catch (const Error&) {
    release(f);
    throw;
  }
  f.done = take_event();
  ops_->event_record(f.done, stream_);
  publish_enqueued(local, f.done);
  in_flight_.push_back(std::move(f));
  if (watcher_)  // never throws: polls still complete it
    in_flight_.back().ticket = watcher_->watch(in_flight_.back().done);
  return false;
}

// Each local entry's handle learns how to order a stream after its work (see
// HandleState::mark_enqueued). Events are recycled (take_event) once complete,
// for later done-events or producer waits; a stream that waits on one late
// then waits for that later work: longer, never too short. The weak
// reference: a handle may outlive this executor (it is then done: failed).
void GpuExecutor::publish_enqueued(const std::vector<Entry*>& local, GpuEvent done) {
  std::weak_ptr<GpuOps> ops = ops_;
  for (Entry* e : local) {
    if (!e || !e->handle) continue;
    e->handle->mark_enqueued(
        [ops, done](void* stream) {
          if (std::shared_ptr<GpuOps> o = ops.lock()) o->caller_stream_wait(stream, done);
        },
        stream_);
  }
}

// One wait per distinct ready event; one recorded event per distinct
// producer stream among the entries that brought no event.
void GpuExecutor::wait_for_producers(const std::vector<Entry*>& local, InFlight& f) {
  std::vector<void*> events, streams;
  for (Entry* e : local) {
    if (!e) continue;
    if (e->gpu_ready_event) {
      if (std::find(events.begin(), events.end(), e->gpu_ready_event) != events.end()) continue;
      events.push_back(e->gpu_ready_event);
      ops_->stream_wait_event(stream_, e->gpu_ready_event);
      continue;
    }
    if (std::find(streams.begin(), streams.end(), e->gpu_stream) != streams.end()) continue;
    streams.push_back(e->gpu_stream);
    GpuEvent ev = take_event();
    f.waits.push_back(ev);
    ops_->event_record(ev, e->gpu_stream);
    ops_->stream_wait_event(stream_, ev);
  }
}

void GpuExecutor::allreduce_fused(const Response& r, const std::vector<Entry*>& local, bool hier) {
  const RequestMeta& m = r.tensors.front();
  std::vector<PackEntry> entries;
  for (size_t i = 0; i < r.tensors.size(); ++i)
    entries.push_back(PackEntry{local[i] ? addr_of(local[i]->in) : 0, r.tensors[i].bytes()});
  // The layout only: offsets from 0, descriptors rebuilt below for the
  // entries this rank has (pack from the inputs, unpack to the outputs).
  const PackPlan layout = plan_pack(entries, 0, std::numeric_limits<uint64_t>::max(), opt_.pack);
  const uint64_t item = dtype_size(m.dtype);
  const uint64_t buf = fusion(hier ? hierarchical_bytes(m, layout.bytes, item) : layout.bytes);
  const auto [ins, outs] = local_addresses(local);
  const FusedCopies c = fused_copies(layout, entries, ins, outs, buf, item, item);
  if (!c.pack.empty()) ops_->launch_pack(c.pack, layout.launch, stream_);
  const uint64_t count = layout.bytes / item;
  ReducePlan p = plan_reduce(r);
  if (hier && p.op == DeviceOp::kAvg) p = {DeviceOp::kSum, p.postscale / cur_->size};
  if (m.prescale != 1.0) ops_->launch_scale(buf, count, m.dtype, m.prescale, stream_);
  fill_absent(r, local, buf, layout.offsets, m.dtype);  // after the prescale: stays neutral
  if (hier)
    allreduce_hierarchical(m, m.dtype, buf, count, p.op);
  else
    nccl().nccl_allreduce(buf, buf, count, m.dtype, p.op, stream_);
  if (p.postscale != 1.0) ops_->launch_scale(buf, count, m.dtype, p.postscale, stream_);
  if (!c.unpack.empty()) ops_->launch_unpack(c.unpack, layout.launch, stream_);
}

// Each local entry's input and result addresses (0, 0 where this rank has none).
std::pair<std::vector<uint64_t>, std::vector<uint64_t>> GpuExecutor::local_addresses(
    const std::vector<Entry*>& local) {
  std::vector<uint64_t> ins(local.size(), 0), outs(local.size(), 0);
  for (size_t i = 0; i < local.size(); ++i) {
    if (!local[i]) continue;
    ins[i] = addr_of(local[i]->in);
    outs[i] = local[i]->out ? addr_of(local[i]->out) : ins[i];
  }
  return {ins, outs};
}

void GpuExecutor::allreduce_one(const Response& r, Entry* e) {
  const RequestMeta& m = r.tensors.front();
  const uint64_t bytes = m.bytes();
  const uint64_t count = bytes / dtype_size(m.dtype);
  const ReducePlan p = plan_reduce(r);
  uint64_t data;
  if (e) {
    uint64_t in = addr_of(e->in);
    const uint64_t out = e->out ? addr_of(e->out) : in;
    if (m.prescale != 1.0) {  // the input stays as the caller gave it
      if (in != out) ops_->memcpy_async(out, in, bytes, stream_);
      ops_->launch_scale(out, count, m.dtype, m.prescale, stream_);
      in = out;
    }
    nccl().nccl_allreduce(in, out, count, m.dtype, p.op, stream_);
    data = out;
  } else {  // joined: the op's neutral elements from scratch space
    data = fusion(bytes);
    fill_neutral(data, count, m.dtype, m.op);
    nccl().nccl_allreduce(data, data, count, m.dtype, p.op, stream_);
  }
  if (p.postscale != 1.0) ops_->launch_scale(data, count, m.dtype, p.postscale, stream_);
}

void GpuExecutor::broadcast_one(const Response& r, Entry* e) {
  const RequestMeta& m = r.tensors.front();
  const uint64_t count = m.bytes() / dtype_size(m.dtype);
  if (e) {
    const uint64_t out = e->out ? addr_of(e->out) : addr_of(e->in);
    const uint64_t in = e->in ? addr_of(e->in) : out;
    nccl().nccl_broadcast(in, out, count, m.dtype, m.root, stream_);
  } else {
    const uint64_t buf = fusion(m.bytes());
    nccl().nccl_broadcast(buf, buf, count, m.dtype, m.root, stream_);
  }
}

// Grows by doubling; the old buffer is freed behind the work already on the
// stream (in order, so nothing enqueued later can still use it).
uint64_t GpuExecutor::fusion(uint64_t bytes) {
  if (bytes <= fusion_bytes_) return fusion_addr_;
  const uint64_t grown = std::max(bytes, 2 * fusion_bytes_);
  if (fusion_addr_) ops_->free_device(fusion_addr_, stream_);
  fusion_addr_ = 0;
  fusion_bytes_ = 0;
  fusion_addr_ = ops_->malloc_device(grown);
  fusion_bytes_ = grown;
  return fusion_addr_;
}

GpuEvent GpuExecutor::take_event() {
  while (!watched_.empty() && watcher_ && watcher_->passed(watched_.front().first)) {
    free_events_.push_back(watched_.front().second);
    watched_.pop_front();
  }
  if (!free_events_.empty()) {
    GpuEvent e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  GpuEvent e = ops_->event_create();
  all_events_.push_back(e);
  return e;
}

void GpuExecutor::release(InFlight& f) {
  if (f.done && f.ticket && watcher_ && !watcher_->passed(f.ticket))
    watched_.emplace_back(f.ticket, f.done);  // the watcher may not have reached it yet
  else if (f.done)
    free_events_.push_back(f.done);
  free_events_.insert(free_events_.end(), f.waits.begin(), f.waits.end());
  f.done = nullptr;
  f.waits.clear();
}

void GpuExecutor::fail_in_flight(const std::string& why) {
  broken_ = why;
  abort_comms();  // ends NCCL calls waiting for a peer: the stream then runs on
  drain_in_flight();
  for (InFlight& f : in_flight_) {
    Completion c;
    c.names = std::move(f.names);
    c.ok = false;
    c.message = why;
    finished_.push_back(std::move(c));
  }
  in_flight_.clear();  // their events may never complete: not reused
}

// Work in flight may be an NCCL call waiting for the peer that failed, and a
// framework's stream may wait for it (stream-ordered waits): it is aborted
// and drained like a failure of its own.
void GpuExecutor::abort(const std::string& why) {
  if (!broken_.empty()) return;
  if (in_flight_.empty()) {
    broken_ = why;
    return;
  }
  fail_in_flight(why);
}

// Work enqueued behind the failed call still runs once the communicator is
// aborted (an unpack writes its outputs): the handles fail only after it has,
// or the framework could hand their memory to new tensors under a late write.
// Bounded: a device that never drains is reported after drain_seconds anyway.
// A CUDA error is sticky, so its events answer at once.
void GpuExecutor::drain_in_flight() {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(opt_.drain_seconds);
  for (const InFlight& f : in_flight_) {
    std::string ignored;
    while (ops_->event_query(f.done, &ignored) == EventState::kPending) {
      if (std::chrono::steady_clock::now() >= deadline) return;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

// Finished work first, then NCCL's asynchronous error for what is left: a
// peer that exits right after its last collective is an error only for the
// work still waiting for it (the first GPU run of the dead-rank test failed
// rank 0's finished allreduce when the error check came first).
std::vector<Completion> GpuExecutor::poll() {
  // One stream: work completes in the order it was enqueued.
  while (!in_flight_.empty()) {
    std::string cuda;
    const EventState st = ops_->event_query(in_flight_.front().done, &cuda);
    if (st == EventState::kPending) break;
    if (st == EventState::kError) {
      fail_in_flight(cat("CUDA failed on GPU ", opt_.device, ": ", cuda));
      break;
    }
    Completion c;
    c.names = std::move(in_flight_.front().names);
    finished_.push_back(std::move(c));
    release(in_flight_.front());
    in_flight_.pop_front();
  }
  for (auto& kv : comms_) {
    if (in_flight_.empty()) break;
    const std::string nccl = kv.second.alive ? kv.second.ops->nccl_async_error() : "";
    if (nccl.empty()) continue;
    fail_in_flight(cat("NCCL failed on GPU ", opt_.device, ": ", nccl));
  }
  std::vector<Completion> out;
  out.swap(finished_);
  return out;
}

}  // namespace gpu
}  // namespace rr
