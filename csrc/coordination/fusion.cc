#include "coordination/fusion.h"

#include <map>
#include <string>
#include <tuple>

namespace rr {

namespace {

using FuseKey = std::tuple<int, int, double, double, int, int, std::string>;

FuseKey key_of(const Response& r) {
  const RequestMeta& m = r.tensors.front();
  return {static_cast<int>(m.dtype), static_cast<int>(m.op), m.prescale, m.postscale, m.device,
          r.contributors, m.group};
}

bool fusable(const Response& r) {
  return r.type == RespType::kExec && r.tensors.size() == 1 &&
         r.tensors[0].kind == CollKind::kAllreduce;
}

uint64_t total_bytes(const Response& r) {
  uint64_t b = 0;
  for (const auto& t : r.tensors) b += t.bytes();
  return b;
}

}  // namespace

std::vector<Response> plan_fusion(const std::vector<Response>& ready, uint64_t threshold) {
  std::vector<Response> out;
  std::map<FuseKey, size_t> open;  // key -> index in `out` still taking tensors
  for (const Response& r : ready) {
    if (!fusable(r)) {
      out.push_back(r);
      continue;
    }
    const RequestMeta& m = r.tensors[0];
    const bool grouped = !m.group.empty();
    if (!grouped && m.bytes() >= threshold) {
      out.push_back(r);
      continue;
    }
    FuseKey key = key_of(r);
    auto it = open.find(key);
    if (it != open.end() && (grouped || total_bytes(out[it->second]) + m.bytes() <= threshold)) {
      out[it->second].tensors.push_back(m);
      continue;
    }
    open[key] = out.size();
    out.push_back(r);
  }
  return out;
}

}  // namespace rr
