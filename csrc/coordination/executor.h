// Op execution behind one interface, so a device backend (NCCL on GPU
// buffers, a later issue) plugs in without the coordination code knowing:
// the engine hands each agreed response to the executor for its device.
//
// `local[i]` is this rank's entry for response.tensors[i], or nullptr when
// this rank has joined and takes part with a neutral contribution. The
// executor fills the entries' results; the engine resolves their handles.
// Errors propagate as rr::Error; the engine decides what they break.
#pragma once

#include <memory>
#include <vector>

#include "coordination/handle.h"
#include "coordination/request.h"
#include "transport/context.h"

namespace rr {

class Timeline;

class Executor {
 public:
  virtual ~Executor() = default;
  virtual void execute(const Response& r, const std::vector<Entry*>& local) = 0;
};

// Host memory: tensor fusion through a persistent fusion buffer, collectives
// over the Context's shm / TCP links.
std::unique_ptr<Executor> make_cpu_executor(Context& ctx, Timeline* timeline);

// Fills `count` elements with the neutral element of `op` (0 for Sum and
// Average, 1 for Product, the largest value for Min, the lowest for Max).
void fill_identity(void* buf, size_t count, DType dtype, ReduceOp op);

}  // namespace rr
