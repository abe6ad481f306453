#include "coordination/fusion.h"

#include <map>
#include <string>
#include <tuple>

namespace rr {

namespace {

using FuseKey =
    std::tuple<int, int, double, double, int, int, std::string, std::vector<int32_t>, int>;

FuseKey key_of(const Response& r) {
  const RequestMeta& m = r.tensors.front();
  return {static_cast<int>(m.dtype),
          static_cast<int>(m.op),
          m.prescale,
          m.postscale,
          m.device,
          r.contributors,
          m.group,
          m.members,
          m.wire};
}

bool fusable(const Response& r) {
  return r.type == RespType::kExec && r.tensors.size() == 1 &&
         r.tensors[0].kind == CollKind::kAllreduce;
}

}  // namespace

std::vector<Response> plan_fusion(std::vector<Response> ready, uint64_t threshold) {
  std::vector<Response> out;
  std::map<FuseKey, size_t> open;  // key -> index in `out` still taking tensors
  std::vector<uint64_t> bytes;     // per response in `out`, what its tensors hold so far
  out.reserve(ready.size());
  for (Response& r : ready) {
    const bool fuse = fusable(r);
    const uint64_t n = fuse ? r.tensors[0].bytes() : 0;  // only fused responses are counted
    const bool grouped = fuse && !r.tensors[0].group.empty();
    if (!fuse || (!grouped && n >= threshold)) {
      out.push_back(std::move(r));
      bytes.push_back(n);
      continue;
    }
    FuseKey key = key_of(r);
    auto it = open.find(key);
    if (it != open.end() && (grouped || bytes[it->second] + n <= threshold)) {
      out[it->second].tensors.push_back(std::move(r.tensors[0]));
      bytes[it->second] += n;
      continue;
    }
    open.insert_or_assign(std::move(key), out.size());
    out.push_back(std::move(r));
    bytes.push_back(n);
  }
  return out;
}

}  // namespace rr
