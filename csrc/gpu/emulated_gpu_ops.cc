#include "gpu/emulated_gpu_ops.h"

#include <cstdlib>
#include <cstring>
#include <set>
#include <vector>

#include "collectives/collectives.h"
#include "common/error.h"
#include "gpu/kernels_reference.h"

namespace rr {
namespace gpu {
namespace {

uint8_t* ptr(uint64_t a) {
  return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(a));
}
uint64_t addr(const void* p) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
}

Tensor flat(uint64_t data, uint64_t count, DType dtype, const char* what) {
  Tensor t;
  t.data = ptr(data);
  t.shape = {static_cast<int64_t>(count)};
  t.dtype = dtype;
  t.name = cat("emulated ", what);
  return t;
}

class EmulatedGpuOps : public GpuOps {
 public:
  EmulatedGpuOps(Context& ctx, int nccl_version) : ctx_(ctx), nccl_version_(nccl_version) {}
  ~EmulatedGpuOps() override {
    for (uint64_t a : allocations_) std::free(ptr(a));
  }

  void set_device(int) override {}
  // Non-null handles that are never dereferenced.
  GpuStream stream_create() override { return ptr(++next_handle_); }
  void stream_destroy(GpuStream) override {}
  GpuEvent event_create() override { return ptr(++next_handle_); }
  void event_destroy(GpuEvent) override {}
  void event_record(GpuEvent, GpuStream) override {}
  void stream_wait_event(GpuStream, GpuEvent) override {}
  EventState event_query(GpuEvent, std::string*) override { return EventState::kDone; }
  // Work runs when it is enqueued: done already.
  EventState event_synchronize(GpuEvent, std::string*) override { return EventState::kDone; }
  uint64_t malloc_device(uint64_t bytes) override {
    const uint64_t rounded = (bytes + 255) / 256 * 256 + 256;
    void* p = std::aligned_alloc(256, rounded);
    if (!p) throw_error(ErrorKind::kInternal, "emulated GPU: out of host memory (", bytes, " B)");
    allocations_.insert(addr(p));
    return addr(p);
  }
  void free_device(uint64_t a, GpuStream) override {
    if (allocations_.erase(a)) std::free(ptr(a));
  }
  void memset_async(uint64_t a, uint64_t bytes, GpuStream) override {
    std::memset(ptr(a), 0, bytes);
  }
  void memcpy_async(uint64_t dst, uint64_t src, uint64_t bytes, GpuStream) override {
    std::memmove(ptr(dst), ptr(src), bytes);
  }
  void launch_pack(const std::vector<CopyDesc>& descs, LaunchArgs, GpuStream) override {
    reference_copy(descs, true);
  }
  void launch_unpack(const std::vector<CopyDesc>& descs, LaunchArgs, GpuStream) override {
    reference_copy(descs, false);
  }
  void launch_scale(uint64_t a, uint64_t count, DType dtype, double factor, GpuStream) override {
    reference_scale(ptr(a), count, dtype, factor);
  }

  void launch_pack_cast(const std::vector<CopyDesc>& descs, DType tensor, DType wire, double factor,
                        LaunchArgs, GpuStream) override {
    reference_cast_copy(descs, true, tensor, wire, factor);
  }
  void launch_unpack_cast(const std::vector<CopyDesc>& descs, DType tensor, DType wire,
                          double factor, LaunchArgs, GpuStream) override {
    reference_cast_copy(descs, false, tensor, wire, factor);
  }
  void launch_fill(uint64_t a, uint64_t count, uint32_t item_bytes, uint64_t pattern,
                   GpuStream) override {
    reference_fill(ptr(a), count, item_bytes, pattern);
  }

  int nccl_version() const override { return nccl_version_; }
  std::string nccl_unique_id() override { return std::string(128, 'E'); }
  void nccl_comm_init(const std::string& id, int size, int rank) override {
    if (id.size() != 128 || size != ctx_.size() || rank != ctx_.rank())
      throw_error(ErrorKind::kInternal, "emulated GPU: communicator of ", size, " ranks as rank ",
                  rank, " over a context of ", ctx_.size(), " as rank ", ctx_.rank());
  }
  void nccl_allreduce(uint64_t send, uint64_t recv, uint64_t count, DType dtype, DeviceOp op,
                      GpuStream) override {
    allreduce(ctx_, flat(send, count, dtype, "ncclAllReduce"), ptr(recv), host_op(op), 1.0, 1.0);
  }
  void nccl_broadcast(uint64_t send, uint64_t recv, uint64_t count, DType dtype, int root,
                      GpuStream) override {
    if (ctx_.rank() == root && send != recv)
      std::memmove(ptr(recv), ptr(send), count * dtype_size(dtype));
    broadcast(ctx_, ptr(recv), flat(recv, count, dtype, "ncclBroadcast"), root);
  }
  // In place as NCCL allows it (send inside recv, or recv inside send): the
  // host collectives get a copy of what is sent.
  void nccl_allgather(uint64_t send, uint64_t recv, uint64_t send_count, DType dtype,
                      GpuStream) override {
    const uint64_t bytes = send_count * dtype_size(dtype);
    std::vector<uint8_t> copy(ptr(send), ptr(send) + bytes);
    allgather(ctx_, flat(addr(copy.data()), send_count, dtype, "ncclAllGather"),
              [recv](const std::vector<int64_t>&) { return ptr(recv); });
  }
  void nccl_reducescatter(uint64_t send, uint64_t recv, uint64_t recv_count, DType dtype,
                          DeviceOp op, GpuStream) override {
    const uint64_t total = recv_count * static_cast<uint64_t>(ctx_.size());
    std::vector<uint8_t> copy(ptr(send), ptr(send) + total * dtype_size(dtype));
    reducescatter(ctx_, flat(addr(copy.data()), total, dtype, "ncclReduceScatter"), host_op(op),
                  1.0, 1.0, [recv](const std::vector<int64_t>&) { return ptr(recv); });
  }
  // Point-to-point calls are collected until the group ends, then run as one
  // pairwise alltoall of bytes (at most one send and one receive per peer,
  // as the executor issues them; a peer without one moves 0 bytes).
  void nccl_group_start() override {
    sends_.assign(static_cast<size_t>(ctx_.size()), Block{});
    recvs_.assign(static_cast<size_t>(ctx_.size()), Block{});
  }
  void nccl_send(uint64_t send, uint64_t count, DType dtype, int peer, GpuStream) override {
    sends_.at(static_cast<size_t>(peer)) = Block{send, count * dtype_size(dtype)};
  }
  void nccl_recv(uint64_t recv, uint64_t count, DType dtype, int peer, GpuStream) override {
    recvs_.at(static_cast<size_t>(peer)) = Block{recv, count * dtype_size(dtype)};
  }
  void nccl_group_end() override;
  std::string nccl_async_error() override { return ""; }
  void nccl_abort() override {}

 private:
  struct Block {
    uint64_t addr = 0, bytes = 0;
  };
  Context& ctx_;
  const int nccl_version_;
  std::vector<Block> sends_, recvs_;
  uint64_t next_handle_ = 0;
  std::set<uint64_t> allocations_;
};

void EmulatedGpuOps::nccl_group_end() {
  const size_t n = sends_.size();
  std::vector<size_t> send_off(n + 1, 0), recv_off(n + 1, 0);
  for (size_t p = 0; p < n; ++p) {
    send_off[p + 1] = send_off[p] + sends_[p].bytes;
    recv_off[p + 1] = recv_off[p] + recvs_[p].bytes;
  }
  std::vector<uint8_t> in(send_off[n]), out(recv_off[n]);
  for (size_t p = 0; p < n; ++p)
    if (sends_[p].bytes) std::memcpy(in.data() + send_off[p], ptr(sends_[p].addr), sends_[p].bytes);
  alltoall_pairwise(ctx_, in.data(), send_off, out.data(), recv_off, "emulated ncclSend/ncclRecv");
  for (size_t p = 0; p < n; ++p)
    if (recvs_[p].bytes)
      std::memcpy(ptr(recvs_[p].addr), out.data() + recv_off[p], recvs_[p].bytes);
  sends_.clear();
  recvs_.clear();
}

}  // namespace

std::shared_ptr<GpuOps> make_emulated_gpu_ops(Context& ctx, int nccl_version) {
  return std::make_shared<EmulatedGpuOps>(ctx, nccl_version);
}

}  // namespace gpu
}  // namespace rr
