#include "gpu/fake_gpu_ops.h"

#include <sstream>

#include "common/error.h"

namespace rr {
namespace gpu {
namespace {

uint64_t id_of(const void* p) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
}
void* handle_of(uint64_t id) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(id));
}
std::string stream_name(GpuStream s) {
  return s ? cat("stream#", id_of(s)) : std::string("stream#default");
}
std::string event_name(GpuEvent e) {
  return cat("event#", id_of(e));
}
std::string hex(uint64_t a) {
  std::ostringstream o;
  o << "0x" << std::hex << a;
  return o.str();
}
// The first 4 bytes of an id, as hex digits (enough to tell ids apart).
std::string hex_prefix(const std::string& id) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < id.size() && i < 4; ++i) {
    const auto b = static_cast<unsigned char>(id[i]);
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}
std::string factor_str(double f) {
  std::ostringstream o;
  o.precision(17);
  o << f;
  return o.str();
}

}  // namespace

const char* device_op_name(DeviceOp op) {
  switch (op) {
    case DeviceOp::kSum: return "sum";
    case DeviceOp::kProd: return "prod";
    case DeviceOp::kMin: return "min";
    case DeviceOp::kMax: return "max";
    case DeviceOp::kAvg: return "avg";
  }
  return "?";
}

ReduceOp host_op(DeviceOp op) {
  switch (op) {
    case DeviceOp::kSum: return ReduceOp::kSum;
    case DeviceOp::kProd: return ReduceOp::kProduct;
    case DeviceOp::kMin: return ReduceOp::kMin;
    case DeviceOp::kMax: return ReduceOp::kMax;
    case DeviceOp::kAvg: return ReduceOp::kAverage;
  }
  return ReduceOp::kSum;
}

std::vector<std::string> FakeGpuOps::calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_;
}

void FakeGpuOps::clear_calls() {
  std::lock_guard<std::mutex> lock(mu_);
  calls_.clear();
}

void FakeGpuOps::complete_all(bool sticky) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, st] : events_)
    if (st == EventState::kPending) st = EventState::kDone;
  sticky_done_ = sticky;
  sync_cv_.notify_all();
}

void FakeGpuOps::set_event(uint64_t id, EventState state, const std::string& error) {
  std::lock_guard<std::mutex> lock(mu_);
  events_[id] = state;
  event_errors_[id] = error;
  sync_cv_.notify_all();
}

void FakeGpuOps::defer_rings(bool defer) {
  std::lock_guard<std::mutex> lock(mu_);
  defer_rings_ = defer;
  sync_cv_.notify_all();
}

void FakeGpuOps::ring_late() {
  std::lock_guard<std::mutex> lock(mu_);
  ++late_releases_;
  sync_cv_.notify_all();
}

// As a device's: returns once the test completed (or failed) the event, and
// with defer_rings on only after a later ring_late().
EventState FakeGpuOps::event_synchronize(GpuEvent e, std::string* error) {
  std::unique_lock<std::mutex> lock(mu_);
  auto fail = fail_next_.find("event_synchronize");  // not logged: it enqueues no work
  if (fail != fail_next_.end()) {
    const std::string msg = fail->second;
    fail_next_.erase(fail);
    throw_error(ErrorKind::kInternal, msg);
  }
  ++syncs_;
  const uint64_t released = late_releases_;
  auto state = [&] {
    auto it = events_.find(id_of(e));
    return it == events_.end() ? EventState::kDone : it->second;
  };
  sync_cv_.wait(lock, [&] {
    return state() != EventState::kPending && (!defer_rings_ || late_releases_ != released);
  });
  const EventState st = state();
  if (st == EventState::kError && error) *error = event_errors_[id_of(e)];
  return st;
}

uint64_t FakeGpuOps::syncs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return syncs_;
}

void FakeGpuOps::set_async_error(const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  async_error_ = message;
}

void FakeGpuOps::fail_next(const std::string& call, const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_next_[call] = message;
}

void FakeGpuOps::log(const std::string& call, const std::string& line) {
  calls_.push_back(line);
  auto it = fail_next_.find(call);
  if (it == fail_next_.end()) return;
  const std::string msg = it->second;
  fail_next_.erase(it);
  throw_error(ErrorKind::kInternal, msg);
}

void FakeGpuOps::set_device(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  log("set_device", cat("set_device ", device));
}

GpuStream FakeGpuOps::stream_create() {
  std::lock_guard<std::mutex> lock(mu_);
  GpuStream s = handle_of(next_stream_++);
  log("stream_create", cat("stream_create -> ", stream_name(s)));
  return s;
}

void FakeGpuOps::stream_destroy(GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  log("stream_destroy", cat("stream_destroy ", stream_name(s)));
}

GpuEvent FakeGpuOps::event_create() {
  std::lock_guard<std::mutex> lock(mu_);
  GpuEvent e = handle_of(next_event_++);
  log("event_create", cat("event_create -> ", event_name(e)));
  return e;
}

void FakeGpuOps::event_destroy(GpuEvent e) {
  std::lock_guard<std::mutex> lock(mu_);
  log("event_destroy", cat("event_destroy ", event_name(e)));
}

void FakeGpuOps::event_record(GpuEvent e, GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  events_[id_of(e)] = sticky_done_ ? EventState::kDone : EventState::kPending;
  event_errors_.erase(id_of(e));
  log("event_record", cat("event_record ", event_name(e), " ", stream_name(s)));
  sync_cv_.notify_all();  // a state change, like the others (event_synchronize)
}

void FakeGpuOps::stream_wait_event(GpuStream s, GpuEvent e) {
  std::lock_guard<std::mutex> lock(mu_);
  log("stream_wait_event", cat("stream_wait_event ", stream_name(s), " ", event_name(e)));
}

EventState FakeGpuOps::event_query(GpuEvent e, std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = events_.find(id_of(e));
  const EventState st = it == events_.end() ? EventState::kDone : it->second;  // never recorded
  if (st == EventState::kError && error) *error = event_errors_[id_of(e)];
  return st;  // not logged: polling repeats it at any rate
}

uint64_t FakeGpuOps::malloc_device(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t a = next_addr_;
  next_addr_ += (bytes + 0xfffff) / 0x100000 * 0x100000 + 0x100000;  // 1 MiB apart, aligned
  log("malloc_device", cat("malloc_device ", bytes, " -> ", hex(a)));
  return a;
}

void FakeGpuOps::free_device(uint64_t addr, GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  log("free_device", cat("free_device ", hex(addr), " ", stream_name(s)));
}

void FakeGpuOps::memset_async(uint64_t addr, uint64_t bytes, GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  log("memset_async", cat("memset_async ", hex(addr), " ", bytes, " ", stream_name(s)));
}

void FakeGpuOps::memcpy_async(uint64_t dst, uint64_t src, uint64_t bytes, GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  log("memcpy_async",
      cat("memcpy_async ", hex(dst), " ", hex(src), " ", bytes, " ", stream_name(s)));
}

void FakeGpuOps::launch_pack(const std::vector<CopyDesc>& descs, LaunchArgs launch, GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string d;
  for (const CopyDesc& c : descs) d += cat(" ", hex(c.tensor), "->", hex(c.fused), ":", c.bytes);
  log("launch_pack", cat("launch_pack ", descs.size(), " descs ", launch.blocks, "x",
                         launch.threads, " ", stream_name(s), d));
}

void FakeGpuOps::launch_unpack(const std::vector<CopyDesc>& descs, LaunchArgs launch, GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string d;
  for (const CopyDesc& c : descs) d += cat(" ", hex(c.fused), "->", hex(c.tensor), ":", c.bytes);
  log("launch_unpack", cat("launch_unpack ", descs.size(), " descs ", launch.blocks, "x",
                           launch.threads, " ", stream_name(s), d));
}

void FakeGpuOps::launch_scale(uint64_t addr, uint64_t count, DType dtype, double factor,
                              GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  log("launch_scale", cat("launch_scale ", hex(addr), " ", count, " ", dtype_name(dtype), " ",
                          factor_str(factor), " ", stream_name(s)));
}

// "launch_pack_cast float32->float16 x0.5 2 descs 1x256 stream#1 0x..->0x..:8 ..."
void FakeGpuOps::launch_pack_cast(const std::vector<CopyDesc>& descs, DType tensor, DType wire,
                                  double factor, LaunchArgs launch, GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string d;
  for (const CopyDesc& c : descs) d += cat(" ", hex(c.tensor), "->", hex(c.fused), ":", c.bytes);
  log("launch_pack_cast", cat("launch_pack_cast ", dtype_name(tensor), "->", dtype_name(wire), " x",
                              factor_str(factor), " ", descs.size(), " descs ", launch.blocks, "x",
                              launch.threads, " ", stream_name(s), d));
}

void FakeGpuOps::launch_unpack_cast(const std::vector<CopyDesc>& descs, DType tensor, DType wire,
                                    double factor, LaunchArgs launch, GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string d;
  for (const CopyDesc& c : descs) d += cat(" ", hex(c.fused), "->", hex(c.tensor), ":", c.bytes);
  log("launch_unpack_cast", cat("launch_unpack_cast ", dtype_name(wire), "->", dtype_name(tensor),
                                " x", factor_str(factor), " ", descs.size(), " descs ",
                                launch.blocks, "x", launch.threads, " ", stream_name(s), d));
}

void FakeGpuOps::launch_fill(uint64_t addr, uint64_t count, uint32_t item_bytes, uint64_t pattern,
                             GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  log("launch_fill", cat("launch_fill ", hex(addr), " ", count, " x", item_bytes, "B ",
                         hex(pattern), " ", stream_name(s)));
}

// 128 bytes: the seed, then the count of ids made so far, then zeros.
std::string FakeGpuOps::nccl_unique_id() {
  std::lock_guard<std::mutex> lock(mu_);
  std::string id(128, '\0');
  id[0] = static_cast<char>(id_seed_);
  id[1] = static_cast<char>(++ids_made_);
  log("nccl_unique_id", cat("nccl_unique_id -> ", hex_prefix(id)));
  return id;
}

void FakeGpuOps::nccl_comm_init(const std::string& unique_id, int size, int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  log("nccl_comm_init", cat("nccl_comm_init id=", unique_id.size(), "B:", hex_prefix(unique_id),
                            " size=", size, " rank=", rank));
}

void FakeGpuOps::nccl_allreduce(uint64_t send, uint64_t recv, uint64_t count, DType dtype,
                                DeviceOp op, GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  log("nccl_allreduce", cat("nccl_allreduce ", hex(send), " ", hex(recv), " ", count, " ",
                            dtype_name(dtype), " ", device_op_name(op), " ", stream_name(s)));
}

void FakeGpuOps::nccl_broadcast(uint64_t send, uint64_t recv, uint64_t count, DType dtype, int root,
                                GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  log("nccl_broadcast", cat("nccl_broadcast ", hex(send), " ", hex(recv), " ", count, " ",
                            dtype_name(dtype), " root=", root, " ", stream_name(s)));
}

void FakeGpuOps::nccl_allgather(uint64_t send, uint64_t recv, uint64_t send_count, DType dtype,
                                GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  log("nccl_allgather", cat("nccl_allgather ", hex(send), " ", hex(recv), " ", send_count, " ",
                            dtype_name(dtype), " ", stream_name(s)));
}

void FakeGpuOps::nccl_reducescatter(uint64_t send, uint64_t recv, uint64_t recv_count, DType dtype,
                                    DeviceOp op, GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  log("nccl_reducescatter",
      cat("nccl_reducescatter ", hex(send), " ", hex(recv), " ", recv_count, " ", dtype_name(dtype),
          " ", device_op_name(op), " ", stream_name(s)));
}

void FakeGpuOps::nccl_group_start() {
  std::lock_guard<std::mutex> lock(mu_);
  log("nccl_group_start", "nccl_group_start");
}

void FakeGpuOps::nccl_group_end() {
  std::lock_guard<std::mutex> lock(mu_);
  log("nccl_group_end", "nccl_group_end");
}

void FakeGpuOps::nccl_send(uint64_t send, uint64_t count, DType dtype, int peer, GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  log("nccl_send", cat("nccl_send ", hex(send), " ", count, " ", dtype_name(dtype), " peer=", peer,
                       " ", stream_name(s)));
}

void FakeGpuOps::nccl_recv(uint64_t recv, uint64_t count, DType dtype, int peer, GpuStream s) {
  std::lock_guard<std::mutex> lock(mu_);
  log("nccl_recv", cat("nccl_recv ", hex(recv), " ", count, " ", dtype_name(dtype), " peer=", peer,
                       " ", stream_name(s)));
}

std::string FakeGpuOps::nccl_async_error() {
  std::lock_guard<std::mutex> lock(mu_);
  return async_error_;  // not logged, like event_query
}

void FakeGpuOps::nccl_abort() {
  std::lock_guard<std::mutex> lock(mu_);
  log("nccl_abort", "nccl_abort");
  if (!abort_drains_) return;
  for (auto& [id, st] : events_)
    if (st == EventState::kPending) st = EventState::kDone;
  sync_cv_.notify_all();
}

void FakeGpuOps::set_abort_drains(bool drains) {
  std::lock_guard<std::mutex> lock(mu_);
  abort_drains_ = drains;
}

}  // namespace gpu
}  // namespace rr
