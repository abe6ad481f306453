#include "coordination/request.h"

#include <algorithm>

#include "common/error.h"

namespace rr {

size_t RequestMeta::bytes() const {
  return static_cast<size_t>(num_elements(shape)) * dtype_size(dtype);
}

void RequestMeta::write(ByteWriter& w) const {
  w.put<uint8_t>(static_cast<uint8_t>(kind));
  w.put<uint8_t>(static_cast<uint8_t>(dtype));
  w.put<uint8_t>(static_cast<uint8_t>(op));
  w.put<int32_t>(root);
  w.put<int32_t>(device);
  w.put<double>(prescale);
  w.put<double>(postscale);
  w.put_dims(shape);
  w.put_str(name);
  w.put_str(group);
  w.put<uint32_t>(static_cast<uint32_t>(members.size()));
  for (int32_t r : members) w.put<int32_t>(r);
  w.put<int8_t>(static_cast<int8_t>(wire));
}

RequestMeta RequestMeta::read(ByteReader& r) {
  RequestMeta m;
  m.kind = static_cast<CollKind>(r.get<uint8_t>());
  m.dtype = static_cast<DType>(r.get<uint8_t>());
  m.op = static_cast<ReduceOp>(r.get<uint8_t>());
  m.root = r.get<int32_t>();
  m.device = r.get<int32_t>();
  m.prescale = r.get<double>();
  m.postscale = r.get<double>();
  m.shape = r.get_dims();
  m.name = r.get_str();
  m.group = r.get_str();
  m.members.resize(r.get<uint32_t>());
  for (int32_t& x : m.members) x = r.get<int32_t>();
  m.wire = r.get<int8_t>();
  return m;
}

namespace {

std::string dims_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += cat(i ? "," : "", shape[i]);
  return s + "]";
}

bool reduces(CollKind k) {
  return k == CollKind::kAllreduce || k == CollKind::kReducescatter;
}

// Host memory or a GPU: which GPU is each rank's own (one per process, rank r
// on its local rank's device), so ranks never compare ordinals.
bool same_place(const RequestMeta& a, const RequestMeta& b) {
  return (a.device >= 0) == (b.device >= 0);
}

}  // namespace

std::string RequestMeta::describe() const {
  std::string s = cat(coll_name(kind), " ", dtype_name(dtype), dims_text(shape));
  if (reduces(kind)) {
    s += cat(" op=", reduce_op_name(op));
    if (prescale != 1.0) s += cat(" prescale=", prescale);
    if (postscale != 1.0) s += cat(" postscale=", postscale);
    if (wire >= 0)
      s += cat(" compression=", dtype_is_valid(wire) ? dtype_name(static_cast<DType>(wire)) : "?");
  }
  if (kind == CollKind::kBroadcast) s += cat(" root=", root);
  if (device >= 0) s += cat(" device=", device);
  if (!group.empty()) s += cat(" group='", group, "'");
  if (!members.empty()) s += cat(" process_set=", ranks_text(members));
  return s;
}

bool RequestMeta::has_rank(int rank) const {
  return members.empty() || std::find(members.begin(), members.end(), rank) != members.end();
}

std::string ranks_text(const std::vector<int32_t>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += cat(i ? "," : "", ranks[i]);
  return s + "]";
}

bool operator==(const RequestMeta& a, const RequestMeta& b) {
  return a.kind == b.kind && a.dtype == b.dtype && a.op == b.op && a.root == b.root &&
         same_place(a, b) && a.prescale == b.prescale && a.postscale == b.postscale &&
         a.shape == b.shape && a.name == b.name && a.group == b.group && a.members == b.members &&
         a.wire == b.wire;
}

bool compatible(const RequestMeta& a, const RequestMeta& b) {
  if (a.kind != b.kind || a.dtype != b.dtype || !same_place(a, b) || a.group != b.group ||
      a.members != b.members || a.wire != b.wire || a.shape.size() != b.shape.size())
    return false;
  const bool rows_free = a.kind == CollKind::kAllgather || a.kind == CollKind::kAlltoall;
  for (size_t i = rows_free ? 1 : 0; i < a.shape.size(); ++i)
    if (a.shape[i] != b.shape[i]) return false;
  if (reduces(a.kind) && (a.op != b.op || a.prescale != b.prescale || a.postscale != b.postscale))
    return false;
  return a.kind != CollKind::kBroadcast || a.root == b.root;
}

const char* resp_type_name(RespType t) {
  switch (t) {
    case RespType::kExec: return "exec";
    case RespType::kError: return "error";
    case RespType::kJoinDone: return "join-done";
    case RespType::kStallWarning: return "stall-warning";
    case RespType::kFatal: return "fatal";
  }
  return "unknown";
}

}  // namespace rr
