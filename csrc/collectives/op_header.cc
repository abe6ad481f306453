#include "collectives/op_header.h"

#include <cstddef>
#include <cstring>
#include <map>

#include "common/error.h"

namespace rr {

namespace {

constexpr uint32_t kHeaderMagic = 0x52524f50;  // "RROP"

uint64_t hash_dims(const std::vector<int64_t>& shape) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a over the dims
  for (int64_t d : shape) {
    h ^= static_cast<uint64_t>(d);
    h *= 1099511628211ULL;
  }
  return h ^ shape.size();
}

OpHeader make_header(const OpDesc& d, uint64_t seq, uint64_t extra_bytes) {
  OpHeader h;
  std::memset(&h, 0, offsetof(OpHeader, inline_extra));
  h.magic = kHeaderMagic;
  h.kind = static_cast<uint32_t>(d.kind);
  h.seq = seq;
  h.dtype = static_cast<int32_t>(d.dtype);
  h.op = static_cast<int32_t>(d.op);
  h.root = d.root;
  h.ndim = static_cast<int32_t>(d.shape.size());
  for (size_t i = 0; i < d.shape.size() && i < kMaxHeaderDims; ++i) h.dims[i] = d.shape[i];
  h.dims_hash = hash_dims(d.shape);
  h.prescale = d.prescale;
  h.postscale = d.postscale;
  h.extra_bytes = extra_bytes;
  std::strncpy(h.name, d.name.c_str(), kMaxHeaderName - 1);
  return h;
}

std::string shape_text(const OpHeader& h, bool skip_first) {
  std::string s = cat(dtype_name(static_cast<DType>(h.dtype)), "[");
  for (int i = 0; i < h.ndim && i < kMaxHeaderDims; ++i) {
    if (i) s += ",";
    s += (skip_first && i == 0) ? "*" : std::to_string(h.dims[i]);
  }
  if (h.ndim > kMaxHeaderDims) s += ",...";
  return s + "]";
}

// The part of a header that must agree across ranks for this kind of op,
// rendered as text so a mismatch message can show what each rank sent.
std::string agreement_key(const OpHeader& h) {
  auto kind = static_cast<CollKind>(h.kind);
  std::string s = h.name[0] ? cat(coll_name(kind), " '", h.name, "'") : coll_name(kind);
  switch (kind) {
    case CollKind::kAllreduce:
    case CollKind::kReducescatter:
      return cat(s, " ", shape_text(h, false), "#", h.dims_hash,
                 " op=", reduce_op_name(static_cast<ReduceOp>(h.op)), " prescale=", h.prescale,
                 " postscale=", h.postscale);
    case CollKind::kBroadcast:
      return cat(s, " ", shape_text(h, false), "#", h.dims_hash, " root=", h.root);
    case CollKind::kAllgather:
    case CollKind::kAlltoall: return cat(s, " ", shape_text(h, true), " ndim=", h.ndim);
    case CollKind::kBarrier: return s;
  }
  return s;
}

// Drops the "#hash" detail unless it is the only difference.
std::string readable(const std::string& key) {
  size_t hash = key.find('#');
  if (hash == std::string::npos) return key;
  size_t end = key.find(' ', hash);
  return key.substr(0, hash) + (end == std::string::npos ? "" : key.substr(end));
}

// Binary comparison of what must agree; the common case formats nothing.
bool same_call(const OpHeader& a, const OpHeader& b) {
  if (a.magic != b.magic || a.kind != b.kind || a.seq != b.seq ||
      std::strncmp(a.name, b.name, kMaxHeaderName) != 0)
    return false;
  auto kind = static_cast<CollKind>(a.kind);
  if (kind == CollKind::kBarrier) return true;
  if (a.dtype != b.dtype || a.ndim != b.ndim) return false;
  const int first = (kind == CollKind::kAllgather || kind == CollKind::kAlltoall) ? 1 : 0;
  for (int i = first; i < a.ndim && i < kMaxHeaderDims; ++i)
    if (a.dims[i] != b.dims[i]) return false;
  if (first == 0 && a.dims_hash != b.dims_hash) return false;
  if (kind == CollKind::kBroadcast) return a.root == b.root;
  if (kind == CollKind::kAllreduce || kind == CollKind::kReducescatter)
    return a.op == b.op && a.prescale == b.prescale && a.postscale == b.postscale;
  return true;
}

void check_agreement(const Context& ctx, const OpDesc& d, uint64_t seq,
                     const std::vector<OpHeader>& hs) {
  bool all_same = true;
  for (size_t r = 1; r < hs.size() && all_same; ++r) all_same = same_call(hs[0], hs[r]);
  if (all_same && hs[0].magic == kHeaderMagic) return;
  std::map<std::string, std::vector<int>> groups;
  for (int r = 0; r < static_cast<int>(hs.size()); ++r) {
    if (hs[r].magic != kHeaderMagic)
      throw_error(ErrorKind::kInternal, "rank ", ctx.rank(), ": ", describe_op(d, seq),
                  ": garbage header from rank ", r, " (streams out of step)");
    groups[agreement_key(hs[r])].push_back(r);
  }
  if (groups.size() == 1) return;
  std::string msg = cat("ranks disagree on collective #", seq, " (every rank must make the same ",
                        "collective calls in the same order with matching arguments): ");
  bool first = true;
  for (const auto& [key, ranks] : groups) {
    msg += first ? "" : "; ";
    first = false;
    msg += ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < ranks.size(); ++i) msg += cat(i ? "," : "", ranks[i]);
    msg += " called " + readable(key);
  }
  throw_error(ErrorKind::kMismatch, "rank ", ctx.rank(), ": ", msg);
}

}  // namespace

const char* coll_name(CollKind k) {
  switch (k) {
    case CollKind::kAllreduce: return "allreduce";
    case CollKind::kAllgather: return "allgather";
    case CollKind::kBroadcast: return "broadcast";
    case CollKind::kReducescatter: return "reducescatter";
    case CollKind::kAlltoall: return "alltoall";
    case CollKind::kBarrier: return "barrier";
  }
  return "unknown collective";
}

std::string describe_op(const OpDesc& d, uint64_t seq) {
  if (d.name.empty()) return cat(coll_name(d.kind), " (#", seq, ")");
  return cat(coll_name(d.kind), " '", d.name, "' (#", seq, ")");
}

int64_t num_elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

HeaderExchange exchange_headers(Context& ctx, const OpDesc& d, uint64_t seq, const void* extra,
                                uint64_t extra_bytes) {
  const int n = ctx.size(), me = ctx.rank();
  HeaderExchange x;
  x.headers.resize(n);
  x.extras.resize(n);
  x.headers[me] = make_header(d, seq, extra_bytes);
  const auto* extra_bytes_ptr = static_cast<const uint8_t*>(extra);
  if (extra_bytes) x.extras[me].assign(extra_bytes_ptr, extra_bytes_ptr + extra_bytes);
  if (n == 1) return x;
  const bool inline_mine = extra_bytes <= kInlineExtraBytes;
  if (inline_mine && extra_bytes) std::memcpy(x.headers[me].inline_extra, extra, extra_bytes);
  std::vector<SendOp> sends;
  std::vector<RecvOp> recvs;
  std::vector<CopySink> sinks;
  sinks.reserve(n);
  auto* mine = reinterpret_cast<const uint8_t*>(&x.headers[me]);
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    sends.push_back(SendOp{&ctx.link(r), mine, sizeof(OpHeader)});
    sinks.emplace_back(&x.headers[r]);
    recvs.push_back(RecvOp{&ctx.link(r), &sinks.back(), sizeof(OpHeader)});
  }
  for (int r = 0; r < n && !inline_mine; ++r)
    if (r != me) sends.push_back(SendOp{&ctx.link(r), extra_bytes_ptr, extra_bytes});
  auto what = [&] { return describe_op(d, seq); };
  run_transfers(ctx.progress(), sends, recvs, what, /*wait_sends=*/false);
  recvs.clear();
  sinks.clear();
  for (int r = 0; r < n; ++r) {
    const uint64_t bytes = x.headers[r].extra_bytes;
    if (r == me || bytes == 0) continue;
    if (bytes <= kInlineExtraBytes) {
      x.extras[r].assign(x.headers[r].inline_extra, x.headers[r].inline_extra + bytes);
      continue;
    }
    x.extras[r].resize(bytes);
    sinks.emplace_back(x.extras[r].data());
    recvs.push_back(RecvOp{&ctx.link(r), &sinks.back(), x.headers[r].extra_bytes});
  }
  run_transfers(ctx.progress(), sends, recvs, what);
  check_agreement(ctx, d, seq, x.headers);
  return x;
}

}  // namespace rr
