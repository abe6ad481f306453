// Tensor fusion planning: turns the coordinator's list of ready tensors into
// the response list every rank executes. Small allreduces that could run as
// one (same dtype, op, scales, device, contributors) are packed into one
// response of at most `threshold` bytes, reduced in one fusion buffer. A
// tensor of `threshold` bytes or more runs alone, in place (no copies).
// Members of one grouped_allreduce run as one response whatever their size
// (unless they differ in dtype or a member fails negotiation). Fusion never changes which elements
// are combined, only how many tensors share one ring pass. A response's position is that of its
// first tensor, so the order stays deterministic.
#pragma once

#include <cstdint>
#include <vector>

#include "coordination/request.h"

namespace rr {

std::vector<Response> plan_fusion(std::vector<Response> ready, uint64_t threshold);

}  // namespace rr
