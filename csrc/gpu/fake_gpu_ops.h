// A recording GpuOps for tests (plain C++, always built): every call is
// appended to a log as one line of text, in order, and nothing runs. Streams
// and events are small numbers ("stream#1", "event#2"); device memory is
// addresses from 0x10000000 up that are never dereferenced. Tests decide what
// event_query and nccl_async_error answer. Thread-safe: the engine's thread
// calls it while a test thread reads the log or completes events.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "gpu/gpu_ops.h"

namespace rr {
namespace gpu {

class FakeGpuOps : public GpuOps {
 public:
  // `id_seed` makes this fake's unique ids distinct from another fake's.
  explicit FakeGpuOps(int nccl_version = 22703, uint8_t id_seed = 0)
      : nccl_version_(nccl_version), id_seed_(id_seed) {}

  // ------------------------------------------------- test controls
  std::vector<std::string> calls() const;
  void clear_calls();
  // Every event recorded so far (and, with `sticky`, every later one) now
  // answers kDone.
  void complete_all(bool sticky = false);
  // Event number `id` ("event#<id>") answers `state`; with kError, `error`.
  void set_event(uint64_t id, EventState state, const std::string& error = "");
  void set_async_error(const std::string& message);
  // nccl_abort() completes every pending event (default: like a real device, whose
  // stream runs on once the aborted NCCL call returns); false: a device that hangs.
  void set_abort_drains(bool drains);
  // The next call named `call` (e.g. "nccl_allreduce") throws rr::Error(kInternal, message).
  void fail_next(const std::string& call, const std::string& message);
  // How many event_synchronize calls began (they are not in calls()).
  uint64_t syncs() const;
  // While set, event_synchronize returns only after a ring_late() made after
  // it began: a completion watcher may wake the engine after the engine found
  // the event complete by polling.
  void defer_rings(bool defer);
  void ring_late();

  // --------------------------------------------------------- GpuOps
  void set_device(int device) override;
  GpuStream stream_create() override;
  void stream_destroy(GpuStream s) override;
  GpuEvent event_create() override;
  void event_destroy(GpuEvent e) override;
  void event_record(GpuEvent e, GpuStream s) override;
  void stream_wait_event(GpuStream s, GpuEvent e) override;
  EventState event_query(GpuEvent e, std::string* error) override;
  // Blocks until a test completes (or fails) the event, as a device would.
  EventState event_synchronize(GpuEvent e, std::string* error) override;
  uint64_t malloc_device(uint64_t bytes) override;
  void free_device(uint64_t addr, GpuStream s) override;
  void memset_async(uint64_t addr, uint64_t bytes, GpuStream s) override;
  void memcpy_async(uint64_t dst, uint64_t src, uint64_t bytes, GpuStream s) override;
  void launch_pack(const std::vector<CopyDesc>& descs, LaunchArgs launch, GpuStream s) override;
  void launch_unpack(const std::vector<CopyDesc>& descs, LaunchArgs launch, GpuStream s) override;
  void launch_scale(uint64_t addr, uint64_t count, DType dtype, double factor,
                    GpuStream s) override;
  void launch_pack_cast(const std::vector<CopyDesc>& descs, DType tensor, DType wire, double factor,
                        LaunchArgs launch, GpuStream s) override;
  void launch_unpack_cast(const std::vector<CopyDesc>& descs, DType tensor, DType wire,
                          double factor, LaunchArgs launch, GpuStream s) override;
  void launch_fill(uint64_t addr, uint64_t count, uint32_t item_bytes, uint64_t pattern,
                   GpuStream s) override;
  int nccl_version() const override { return nccl_version_; }
  std::string nccl_unique_id() override;
  void nccl_comm_init(const std::string& unique_id, int size, int rank) override;
  void nccl_allreduce(uint64_t send, uint64_t recv, uint64_t count, DType dtype, DeviceOp op,
                      GpuStream s) override;
  void nccl_broadcast(uint64_t send, uint64_t recv, uint64_t count, DType dtype, int root,
                      GpuStream s) override;
  void nccl_allgather(uint64_t send, uint64_t recv, uint64_t send_count, DType dtype,
                      GpuStream s) override;
  void nccl_reducescatter(uint64_t send, uint64_t recv, uint64_t recv_count, DType dtype,
                          DeviceOp op, GpuStream s) override;
  void nccl_group_start() override;
  void nccl_group_end() override;
  void nccl_send(uint64_t send, uint64_t count, DType dtype, int peer, GpuStream s) override;
  void nccl_recv(uint64_t recv, uint64_t count, DType dtype, int peer, GpuStream s) override;
  std::string nccl_async_error() override;
  void nccl_abort() override;

 private:
  void log(const std::string& call, const std::string& line);  // under mu_
  const int nccl_version_;
  const uint8_t id_seed_;
  uint8_t ids_made_ = 0;
  mutable std::mutex mu_;
  std::vector<std::string> calls_;
  uint64_t next_stream_ = 1, next_event_ = 1, next_addr_ = 0x10000000;
  std::map<uint64_t, EventState> events_;  // recorded events and their state
  std::map<uint64_t, std::string> event_errors_;
  std::condition_variable sync_cv_;  // an event's state changed (event_synchronize)
  uint64_t syncs_ = 0;
  bool defer_rings_ = false;
  uint64_t late_releases_ = 0;
  bool sticky_done_ = false;
  bool abort_drains_ = true;
  std::string async_error_;
  std::map<std::string, std::string> fail_next_;
};

}  // namespace gpu
}  // namespace rr
