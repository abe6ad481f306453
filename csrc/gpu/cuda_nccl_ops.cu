// GpuOps on a real device. Streams are non-blocking (no implicit
// synchronization with the legacy default stream: the executor waits on the
// producers' events explicitly); events carry no timing. NCCL's ncclAvg is
// used only when the executor asks for it (it checks nccl_version()).
// Events use blocking sync: event_synchronize (a watcher thread's,
// completion_watcher.h) sleeps in the driver instead of spinning a core.
#include <cuda_runtime.h>

#include <cstring>

#include "common/error.h"
#include "gpu/cuda_nccl_ops.h"
#include "gpu/kernels.h"

namespace rr {
namespace gpu {
namespace {

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  throw_error(ErrorKind::kInternal, what, " failed: ", cudaGetErrorName(err), ": ",
              cudaGetErrorString(err));
}

void* ptr(uint64_t a) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(a));
}

nccl::DataType nccl_dtype(DType t) {
  switch (t) {
    case DType::kUInt8: return nccl::kUint8;
    case DType::kInt8: return nccl::kInt8;
    case DType::kInt32: return nccl::kInt32;
    case DType::kInt64: return nccl::kInt64;
    case DType::kFloat16: return nccl::kFloat16;
    case DType::kBFloat16: return nccl::kBfloat16;
    case DType::kFloat32: return nccl::kFloat32;
    case DType::kFloat64: return nccl::kFloat64;
    case DType::kBool: return nccl::kUint8;
    case DType::kUInt32: return nccl::kUint32;
    case DType::kUInt64: return nccl::kUint64;
    case DType::kInt16:
    case DType::kUInt16: break;  // NCCL has no 16-bit integers
  }
  throw_error(ErrorKind::kInvalidArgument, "NCCL has no type for dtype ",
              dtype_is_valid(static_cast<int32_t>(t)) ? dtype_name(t) : "(invalid)",
              "; on the GPU use int32 (or move the tensor to the CPU)");
}

nccl::RedOp nccl_op(DeviceOp op) {
  switch (op) {
    case DeviceOp::kSum: return nccl::kSum;
    case DeviceOp::kProd: return nccl::kProd;
    case DeviceOp::kMin: return nccl::kMin;
    case DeviceOp::kMax: return nccl::kMax;
    case DeviceOp::kAvg: return nccl::kAvg;
  }
  return nccl::kSum;
}

// Around an event query or wait, which the engine's and the watcher's threads
// make while a framework may be capturing a CUDA graph on another thread in
// global mode (PyTorch's default): in this thread's own default mode the call
// would be refused and would invalidate that capture. Neither thread captures,
// so thread-local mode loses no check (as PyTorch's NCCL watchdog does).
class NotCapturing {
 public:
  NotCapturing() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~NotCapturing() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  NotCapturing(const NotCapturing&) = delete;
  NotCapturing& operator=(const NotCapturing&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeThreadLocal;
};

class CudaNcclOps : public GpuOps {
 public:
  CudaNcclOps(std::shared_ptr<NcclLibrary> nccl, int device)
      : nccl_(std::move(nccl)), device_(device) {}
  ~CudaNcclOps() override {
    if (comm_) nccl_->api().CommDestroy(comm_);
  }

  void set_device(int device) override {
    device_ = device;
    guard();
  }
  GpuStream stream_create() override {
    guard();
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return s;
  }
  void stream_destroy(GpuStream s) override {
    guard();
    check(cudaStreamSynchronize(static_cast<cudaStream_t>(s)), "cudaStreamSynchronize");
    check(cudaStreamDestroy(static_cast<cudaStream_t>(s)), "cudaStreamDestroy");
  }
  GpuEvent event_create() override {
    guard();
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync),
          "cudaEventCreateWithFlags");
    return e;
  }
  void event_destroy(GpuEvent e) override {
    guard();
    check(cudaEventDestroy(static_cast<cudaEvent_t>(e)), "cudaEventDestroy");
  }
  void event_record(GpuEvent e, GpuStream s) override {
    guard();
    check(cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(s)),
          "cudaEventRecord");
  }
  void stream_wait_event(GpuStream s, GpuEvent e) override {
    guard();
    check(cudaStreamWaitEvent(static_cast<cudaStream_t>(s), static_cast<cudaEvent_t>(e), 0),
          "cudaStreamWaitEvent");
  }
  // On the caller's thread, whose current device it leaves as it was: stream
  // 0 (the legacy default stream) means the current device's, so that is
  // this executor's for the call.
  void caller_stream_wait(GpuStream s, GpuEvent e) override {
    int current = -1;
    check(cudaGetDevice(&current), "cudaGetDevice");
    if (current != device_) check(cudaSetDevice(device_), "cudaSetDevice");
    const cudaError_t err =
        cudaStreamWaitEvent(static_cast<cudaStream_t>(s), static_cast<cudaEvent_t>(e), 0);
    if (current != device_) check(cudaSetDevice(current), "cudaSetDevice");
    check(err, "cudaStreamWaitEvent");
  }
  EventState event_query(GpuEvent e, std::string* error) override {
    guard();
    NotCapturing thread_local_mode;
    const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(e));
    if (err == cudaSuccess) return EventState::kDone;
    if (err == cudaErrorNotReady) return EventState::kPending;
    if (error) *error = cat(cudaGetErrorName(err), ": ", cudaGetErrorString(err));
    return EventState::kError;
  }
  EventState event_synchronize(GpuEvent e, std::string* error) override {
    guard();  // on the watcher's thread too: no context on another device
    NotCapturing thread_local_mode;
    const cudaError_t err = cudaEventSynchronize(static_cast<cudaEvent_t>(e));
    if (err == cudaSuccess) return EventState::kDone;
    if (error) *error = cat(cudaGetErrorName(err), ": ", cudaGetErrorString(err));
    return EventState::kError;
  }
  uint64_t malloc_device(uint64_t bytes) override {
    guard();
    void* p = nullptr;
    check(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
    return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
  }
  // Rare (the fusion buffer grows): waiting for the stream here is cheaper
  // than keeping old buffers alive until an event says so.
  void free_device(uint64_t addr, GpuStream s) override {
    guard();
    if (s) check(cudaStreamSynchronize(static_cast<cudaStream_t>(s)), "cudaStreamSynchronize");
    check(cudaFree(ptr(addr)), "cudaFree");
  }
  void memset_async(uint64_t addr, uint64_t bytes, GpuStream s) override {
    guard();
    check(cudaMemsetAsync(ptr(addr), 0, bytes, static_cast<cudaStream_t>(s)), "cudaMemsetAsync");
  }
  void memcpy_async(uint64_t dst, uint64_t src, uint64_t bytes, GpuStream s) override {
    guard();
    check(
        cudaMemcpyAsync(ptr(dst), ptr(src), bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(s)),
        "cudaMemcpyAsync");
  }
  void launch_pack(const std::vector<CopyDesc>& descs, LaunchArgs launch, GpuStream s) override {
    copy(descs, s, [&](const CopyDesc* dd) { gpu::launch_pack(dd, descs.size(), launch, s); });
  }
  void launch_unpack(const std::vector<CopyDesc>& descs, LaunchArgs launch, GpuStream s) override {
    copy(descs, s, [&](const CopyDesc* dd) { gpu::launch_unpack(dd, descs.size(), launch, s); });
  }
  void launch_scale(uint64_t addr, uint64_t count, DType dtype, double factor,
                    GpuStream s) override {
    guard();
    gpu::launch_scale(ptr(addr), count, dtype, factor, s);
  }

  void launch_pack_cast(const std::vector<CopyDesc>& descs, DType tensor, DType wire, double factor,
                        LaunchArgs launch, GpuStream s) override {
    copy(descs, s, [&](const CopyDesc* dd) {
      gpu::launch_cast_copy(dd, descs.size(), true, tensor, wire, factor, launch, s);
    });
  }
  void launch_unpack_cast(const std::vector<CopyDesc>& descs, DType tensor, DType wire,
                          double factor, LaunchArgs launch, GpuStream s) override {
    copy(descs, s, [&](const CopyDesc* dd) {
      gpu::launch_cast_copy(dd, descs.size(), false, tensor, wire, factor, launch, s);
    });
  }
  void launch_fill(uint64_t addr, uint64_t count, uint32_t item_bytes, uint64_t pattern,
                   GpuStream s) override {
    guard();
    gpu::launch_fill(ptr(addr), count, item_bytes, pattern, s);
  }

  int nccl_version() const override { return nccl_->version(); }
  std::string nccl_unique_id() override {
    nccl::UniqueId id;
    nccl_check(nccl_->api().GetUniqueId(&id), "ncclGetUniqueId");
    return std::string(id.internal, sizeof id.internal);
  }
  void nccl_comm_init(const std::string& unique_id, int size, int rank) override {
    nccl::UniqueId id;
    if (unique_id.size() != sizeof id.internal)
      throw_error(ErrorKind::kInvalidArgument, "an ncclUniqueId has ", sizeof id.internal,
                  " bytes, got ", unique_id.size());
    std::memcpy(id.internal, unique_id.data(), sizeof id.internal);
    guard();
    nccl_check(nccl_->api().CommInitRank(&comm_, size, id, rank), "ncclCommInitRank");
  }
  void nccl_allreduce(uint64_t send, uint64_t recv, uint64_t count, DType dtype, DeviceOp op,
                      GpuStream s) override {
    guard();
    nccl_check(nccl_->api().AllReduce(ptr(send), ptr(recv), count, nccl_dtype(dtype), nccl_op(op),
                                      comm_, s),
               "ncclAllReduce");
  }
  void nccl_broadcast(uint64_t send, uint64_t recv, uint64_t count, DType dtype, int root,
                      GpuStream s) override {
    guard();
    nccl_check(
        nccl_->api().Broadcast(ptr(send), ptr(recv), count, nccl_dtype(dtype), root, comm_, s),
        "ncclBroadcast");
  }
  void nccl_allgather(uint64_t send, uint64_t recv, uint64_t send_count, DType dtype,
                      GpuStream s) override {
    guard();
    nccl_check(
        nccl_->api().AllGather(ptr(send), ptr(recv), send_count, nccl_dtype(dtype), comm_, s),
        "ncclAllGather");
  }
  void nccl_reducescatter(uint64_t send, uint64_t recv, uint64_t recv_count, DType dtype,
                          DeviceOp op, GpuStream s) override {
    guard();
    nccl_check(nccl_->api().ReduceScatter(ptr(send), ptr(recv), recv_count, nccl_dtype(dtype),
                                          nccl_op(op), comm_, s),
               "ncclReduceScatter");
  }
  void nccl_group_start() override { nccl_check(nccl_->api().GroupStart(), "ncclGroupStart"); }
  void nccl_group_end() override {
    guard();
    nccl_check(nccl_->api().GroupEnd(), "ncclGroupEnd");
  }
  void nccl_send(uint64_t send, uint64_t count, DType dtype, int peer, GpuStream s) override {
    guard();
    nccl_check(nccl_->api().Send(ptr(send), count, nccl_dtype(dtype), peer, comm_, s), "ncclSend");
  }
  void nccl_recv(uint64_t recv, uint64_t count, DType dtype, int peer, GpuStream s) override {
    guard();
    nccl_check(nccl_->api().Recv(ptr(recv), count, nccl_dtype(dtype), peer, comm_, s), "ncclRecv");
  }
  std::string nccl_async_error() override {
    if (!comm_) return "";
    nccl::Result r = nccl::kSuccess;
    const nccl::Result q = nccl_->api().CommGetAsyncError(comm_, &r);
    if (q != nccl::kSuccess) return cat("ncclCommGetAsyncError: ", nccl_->error_string(q));
    if (r == nccl::kSuccess || r == nccl::kInProgress) return "";
    return nccl_->error_string(r);
  }
  void nccl_abort() override {
    if (!comm_) return;
    nccl_->api().CommAbort(comm_);
    comm_ = nullptr;
  }

 private:
  void guard() { check(cudaSetDevice(device_), "cudaSetDevice"); }
  void nccl_check(nccl::Result r, const char* what) {
    if (r == nccl::kSuccess || r == nccl::kInProgress) return;
    throw_error(ErrorKind::kInternal, what, " failed: ", nccl_->error_string(r));
  }
  // The descriptors go to the device in stream order (a pageable source is
  // staged before cudaMemcpyAsync returns) and are freed behind the kernel.
  template <class Launch>
  void copy(const std::vector<CopyDesc>& descs, GpuStream s, Launch&& launch_on) {
    if (descs.empty()) return;
    guard();
    auto stream = static_cast<cudaStream_t>(s);
    const size_t bytes = descs.size() * sizeof(CopyDesc);
    void* d = nullptr;
    check(cudaMallocAsync(&d, bytes, stream), "cudaMallocAsync");
    check(cudaMemcpyAsync(d, descs.data(), bytes, cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync");
    launch_on(static_cast<const CopyDesc*>(d));
    check(cudaFreeAsync(d, stream), "cudaFreeAsync");
  }

  std::shared_ptr<NcclLibrary> nccl_;
  int device_;
  nccl::CommPtr comm_ = nullptr;
};

}  // namespace

std::shared_ptr<GpuOps> make_cuda_nccl_ops(std::shared_ptr<NcclLibrary> nccl, int device) {
  return std::make_shared<CudaNcclOps>(std::move(nccl), device);
}

}  // namespace gpu
}  // namespace rr
