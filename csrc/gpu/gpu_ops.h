// The only calls the GPU executor (gpu_executor.h) makes to CUDA and NCCL,
// behind one interface: CudaNcclOps (cuda_nccl_ops.cu, built with CUDA) runs
// them; FakeGpuOps (fake_gpu_ops.h, always built) records them, so the
// executor's planning is unit-tested on machines without a GPU.
//
// Streams, events and the communicator are opaque handles (void* or uint64_t
// addresses); no CUDA or NCCL header is needed here. Every call that
// enqueues work returns without waiting for it. Failures throw rr::Error.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "gpu/pack_plan.h"

namespace rr {
namespace gpu {

using GpuStream = void*;  // cudaStream_t; nullptr is the legacy default stream
using GpuEvent = void*;   // cudaEvent_t

// How a collective reduces on the device (ncclRedOp_t's meaning).
enum class DeviceOp { kSum, kProd, kMin, kMax, kAvg };
const char* device_op_name(DeviceOp op);
// The host collectives' op for a device op (kAvg: kAverage, the sum over all ranks / size).
ReduceOp host_op(DeviceOp op);

// Outcome of one event_query.
enum class EventState { kPending, kDone, kError };

class GpuOps {
 public:
  virtual ~GpuOps() = default;

  // ------------------------------------------------------------ CUDA
  virtual void set_device(int device) = 0;
  virtual GpuStream stream_create() = 0;
  virtual void stream_destroy(GpuStream s) = 0;  // waits for its work first
  virtual GpuEvent event_create() = 0;
  virtual void event_destroy(GpuEvent e) = 0;
  virtual void event_record(GpuEvent e, GpuStream s) = 0;
  virtual void stream_wait_event(GpuStream s, GpuEvent e) = 0;
  // Makes `s`, a stream of the caller's (any thread, any device), wait for `e`:
  // a framework's stream ordered after the executor's work. Thread-safe.
  virtual void caller_stream_wait(GpuStream s, GpuEvent e) { stream_wait_event(s, e); }
  // kDone once every piece of work recorded before `e` has finished; kError
  // with `*error` set when that work failed (a sticky CUDA error).
  virtual EventState event_query(GpuEvent e, std::string* error) = 0;
  // Blocks the calling thread (any thread) until the work recorded before `e`
  // has finished (kDone) or failed (kError, `*error` set), asleep rather than
  // spinning (CompletionWatcher's thread). Thread-safe.
  virtual EventState event_synchronize(GpuEvent e, std::string* error) = 0;
  // Device memory (256-byte aligned), freed after the work enqueued on `s` so far.
  virtual uint64_t malloc_device(uint64_t bytes) = 0;
  virtual void free_device(uint64_t addr, GpuStream s) = 0;
  virtual void memset_async(uint64_t addr, uint64_t bytes, GpuStream s) = 0;  // zeros
  virtual void memcpy_async(uint64_t dst, uint64_t src, uint64_t bytes, GpuStream s) = 0;

  // --------------------------------------------------------- kernels
  // One launch each (kernels.h); the descriptors are host memory here and
  // are copied to the device by the implementation before it returns.
  virtual void launch_pack(const std::vector<CopyDesc>& descs, LaunchArgs launch, GpuStream s) = 0;
  virtual void launch_unpack(const std::vector<CopyDesc>& descs, LaunchArgs launch,
                             GpuStream s) = 0;
  virtual void launch_scale(uint64_t addr, uint64_t count, DType dtype, double factor,
                            GpuStream s) = 0;

  // Compression (kernels.h's launch_cast_copy): pack casts each tensor
  // (`tensor` dtype) times `factor` into the fusion buffer as `wire`; unpack
  // casts back, times `factor`. A descriptor's bytes count its wire side.
  virtual void launch_pack_cast(const std::vector<CopyDesc>& descs, DType tensor, DType wire,
                                double factor, LaunchArgs launch, GpuStream s) = 0;
  virtual void launch_unpack_cast(const std::vector<CopyDesc>& descs, DType tensor, DType wire,
                                  double factor, LaunchArgs launch, GpuStream s) = 0;
  // `count` elements of `item_bytes` (1, 2, 4, 8) set to `pattern`'s low
  // bytes: a joined rank's neutral elements for Min, Max and Product.
  virtual void launch_fill(uint64_t addr, uint64_t count, uint32_t item_bytes, uint64_t pattern,
                           GpuStream s) = 0;

  // ------------------------------------------------------------ NCCL
  virtual int nccl_version() const = 0;  // e.g. 22703; 0: no NCCL
  // ncclGetUniqueId: the 128 bytes one rank makes and every rank passes to
  // nccl_comm_init (gpu_bootstrap.h carries them over the CPU Context).
  virtual std::string nccl_unique_id() = 0;
  // ncclCommInitRank with the 128 bytes of an ncclUniqueId.
  virtual void nccl_comm_init(const std::string& unique_id, int size, int rank) = 0;
  virtual void nccl_allreduce(uint64_t send, uint64_t recv, uint64_t count, DType dtype,
                              DeviceOp op, GpuStream s) = 0;
  virtual void nccl_broadcast(uint64_t send, uint64_t recv, uint64_t count, DType dtype, int root,
                              GpuStream s) = 0;
  virtual void nccl_allgather(uint64_t send, uint64_t recv, uint64_t send_count, DType dtype,
                              GpuStream s) = 0;
  virtual void nccl_reducescatter(uint64_t send, uint64_t recv, uint64_t recv_count, DType dtype,
                                  DeviceOp op, GpuStream s) = 0;
  // ncclGroupStart / ncclGroupEnd around point-to-point calls (alltoall):
  // NCCL runs every send and receive between them as one operation, so no
  // pair of ranks waits on the other's order.
  virtual void nccl_group_start() = 0;
  virtual void nccl_group_end() = 0;
  virtual void nccl_send(uint64_t send, uint64_t count, DType dtype, int peer, GpuStream s) = 0;
  virtual void nccl_recv(uint64_t recv, uint64_t count, DType dtype, int peer, GpuStream s) = 0;
  // ncclCommGetAsyncError: "" while the communicator is healthy, else NCCL's message.
  virtual std::string nccl_async_error() = 0;
  virtual void nccl_abort() = 0;  // ncclCommAbort; the communicator is gone afterwards
};

// NCCL_VERSION(2, 10, 0): the first NCCL with ncclAvg.
constexpr int kNcclAvgVersion = 21000;

}  // namespace gpu
}  // namespace rr
