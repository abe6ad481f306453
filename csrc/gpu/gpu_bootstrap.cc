#include "gpu/gpu_bootstrap.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/collectives.h"
#include "common/error.h"
#include "gpu/gpu_executor.h"

namespace rr {
namespace gpu {
namespace {

constexpr size_t kRecordBytes = 512;  // a status message is cut to fit
constexpr size_t kIdBytes = 128;      // sizeof(ncclUniqueId)

// [1 byte: 0 ok / 1 failed][2 bytes: length][payload]
std::vector<uint8_t> record(bool failed, const std::string& payload) {
  std::vector<uint8_t> r(kRecordBytes, 0);
  const size_t n = std::min(payload.size(), kRecordBytes - 3);
  r[0] = failed ? 1 : 0;
  r[1] = static_cast<uint8_t>(n & 0xff);
  r[2] = static_cast<uint8_t>(n >> 8);
  std::memcpy(r.data() + 3, payload.data(), n);
  return r;
}

bool failed(const uint8_t* r) {
  return r[0] != 0;
}
std::string payload(const uint8_t* r) {
  const size_t n = std::min<size_t>(r[1] | (size_t{r[2]} << 8), kRecordBytes - 3);
  return std::string(reinterpret_cast<const char*>(r + 3), n);
}

Tensor bytes_tensor(const void* data, const std::string& name) {
  Tensor t;
  t.data = data;
  t.shape = {static_cast<int64_t>(kRecordBytes)};
  t.dtype = DType::kUInt8;
  t.name = name;
  return t;
}

// Names are the same on every rank (the header exchange compares them);
// each rank's device may differ.
// Step 1: throws on every rank when any rank cannot use its GPU.
void agree_every_rank_can(Context& ctx, const std::string& why_not) {
  const std::vector<uint8_t> mine = record(!why_not.empty(), why_not);
  std::vector<uint8_t> all(kRecordBytes * static_cast<size_t>(ctx.size()));
  allgather(ctx, bytes_tensor(mine.data(), "gpu bootstrap status"),
            [&all](const std::vector<int64_t>&) { return all.data(); });
  std::string reasons;
  for (int r = 0; r < ctx.size(); ++r) {
    const uint8_t* rec = all.data() + kRecordBytes * static_cast<size_t>(r);
    if (failed(rec)) reasons += cat(reasons.empty() ? "" : "; ", "rank ", r, ": ", payload(rec));
  }
  if (!reasons.empty())
    throw_error(ErrorKind::kInvalidArgument, "GPU collectives need every rank to have a GPU (",
                reasons, ")");
}

// Step 2: rank 0's id (or its failure) on every rank.
std::string share_unique_id(Context& ctx, GpuOps& ops) {
  std::vector<uint8_t> rec;
  if (ctx.rank() == 0) {
    try {
      rec = record(false, ops.nccl_unique_id());
    } catch (const Error& e) {
      rec = record(true, e.what());
    }
  } else {
    rec.assign(kRecordBytes, 0);
  }
  broadcast(ctx, rec.data(), bytes_tensor(rec.data(), "gpu bootstrap id"), 0);
  if (failed(rec.data()))
    throw_error(ErrorKind::kInvalidArgument,
                "rank 0 could not make an NCCL unique id: ", payload(rec.data()));
  std::string id = payload(rec.data());
  if (id.size() != kIdBytes)
    throw_error(ErrorKind::kInternal, "an NCCL unique id has ", kIdBytes, " bytes, rank 0 sent ",
                id.size());
  return id;
}

}  // namespace

std::string agree_on_unique_id(Context& ctx, GpuOps* ops, const std::string& why_not) {
  std::string reason = why_not;
  if (!ops && reason.empty()) reason = "no GPU operations";
  agree_every_rank_can(ctx, reason);
  return share_unique_id(ctx, *ops);
}

std::unique_ptr<Executor> bootstrap_gpu_executor(
    Context& ctx, int32_t device, std::shared_ptr<GpuOps> ops, const std::string& why_not,
    std::function<std::shared_ptr<GpuOps>(Context&)> make_ops, PackOptions pack) {
  GpuExecutorOptions o;
  o.device = device;
  o.rank = ctx.rank();
  o.size = ctx.size();
  o.pack = pack;
  auto ex = std::make_unique<GpuExecutor>(std::move(ops), o);
  ex->bootstrap_over(ctx, std::move(make_ops), why_not);
  return ex;
}

}  // namespace gpu
}  // namespace rr
