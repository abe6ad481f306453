// Compression of a GPU allreduce (RequestMeta::wire: Compression.fp16 /
// .bf16 on float32 or float64 tensors) and a joined rank's neutral elements.
//
// Compressed allreduce, on the executor's stream (every tensor of the
// response, one of them or many):
//   1. ONE pack launch that casts each tensor, times the prescale, into a
//      fusion buffer of the wire dtype (plan_pack's layout over the wire
//      bytes; a descriptor's bytes count its wire side, so a chunk of c wire
//      bytes reads c / 2 x 4 (or 8) tensor bytes);
//   2. a joined rank's absent tensors: the op's neutral elements, in the wire dtype;
//   3. the NCCL allreduce in float16 / bfloat16 (half the bytes of float32);
//   4. ONE unpack launch that casts back, times the postscale.
// The scales run in the tensor's dtype (float32 / float64) inside the casts,
// so each element is rounded to the wire dtype once. Average runs as Sum on
// the wire, and 1 / contributors is folded into the unpack's postscale: the
// division happens in float32, not in float16 (nor by ncclAvg's float16
// premultiply), and costs no launch.
#include <algorithm>
#include <limits>

#include "common/error.h"
#include "gpu/gpu_executor.h"

namespace rr {
namespace gpu {

// Refused alike on every rank (the negotiated metadata is the same).
void GpuExecutor::check_wire(const RequestMeta& m) {
  if (m.wire < 0) return;
  const bool wire_ok = m.wire == static_cast<int32_t>(DType::kFloat16) ||
                       m.wire == static_cast<int32_t>(DType::kBFloat16);
  const bool dtype_ok = m.dtype == DType::kFloat32 || m.dtype == DType::kFloat64;
  if (m.kind == CollKind::kAllreduce && wire_ok && dtype_ok) return;
  throw_error(ErrorKind::kInvalidArgument, coll_name(m.kind), " '", m.name, "': compression to ",
              dtype_is_valid(m.wire) ? dtype_name(static_cast<DType>(m.wire)) : "(invalid)",
              " of a ", dtype_name(m.dtype),
              " tensor on GPU: only allreduces of float32 / "
              "float64 tensors travel as float16 / bfloat16");
}

void GpuExecutor::allreduce_compressed(const Response& r, const std::vector<Entry*>& local,
                                       bool hier) {
  const RequestMeta& m = r.tensors.front();
  const DType wire = static_cast<DType>(m.wire);
  const uint64_t item = dtype_size(m.dtype), wi = dtype_size(wire);
  std::vector<PackEntry> entries;
  for (const RequestMeta& t : r.tensors) entries.push_back(PackEntry{0, t.bytes() / item * wi});
  const PackPlan layout = plan_pack(entries, 0, std::numeric_limits<uint64_t>::max(), opt_.pack);
  const uint64_t buf = fusion(hier ? hierarchical_bytes(m, layout.bytes, wi) : layout.bytes);
  const auto [ins, outs] = local_addresses(local);
  const FusedCopies c = fused_copies(layout, entries, ins, outs, buf, item, wi);
  ReducePlan p = plan_reduce(r);
  if (p.op == DeviceOp::kAvg) p = {DeviceOp::kSum, p.postscale / cur_->size};
  if (!c.pack.empty())
    ops_->launch_pack_cast(c.pack, m.dtype, wire, m.prescale, layout.launch, stream_);
  fill_absent(r, local, buf, layout.offsets, wire);
  const uint64_t count = layout.bytes / wi;
  if (hier)
    allreduce_hierarchical(m, wire, buf, count, p.op);
  else
    nccl().nccl_allreduce(buf, buf, count, wire, p.op, stream_);
  if (!c.unpack.empty())
    ops_->launch_unpack_cast(c.unpack, m.dtype, wire, p.postscale, layout.launch, stream_);
}

// Zeros for Sum and Average (a memset); +inf / -inf / 1 (or an integer
// type's limits) for Min / Max / Product, the host's fill_identity, one launch.
void GpuExecutor::fill_neutral(uint64_t addr, uint64_t count, DType dtype, ReduceOp op) {
  if (count == 0) return;
  if (op == ReduceOp::kSum || op == ReduceOp::kAverage) {
    ops_->memset_async(addr, count * dtype_size(dtype), stream_);
    return;
  }
  uint64_t pattern = 0;
  fill_identity(&pattern, 1, dtype, op);
  ops_->launch_fill(addr, count, static_cast<uint32_t>(dtype_size(dtype)), pattern, stream_);
}

// The tensors of a fused response this rank does not have (it joined), at
// `offsets` in the fusion buffer of `dtype` elements.
void GpuExecutor::fill_absent(const Response& r, const std::vector<Entry*>& local, uint64_t buf,
                              const std::vector<uint64_t>& offsets, DType dtype) {
  const RequestMeta& m = r.tensors.front();
  for (size_t i = 0; i < local.size(); ++i)
    if (!local[i])
      fill_neutral(buf + offsets[i], static_cast<uint64_t>(num_elements(r.tensors[i].shape)), dtype,
                   m.op);
}

}  // namespace gpu
}  // namespace rr
