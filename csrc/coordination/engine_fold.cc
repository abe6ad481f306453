// Folded rounds: a small allreduce finished inside its negotiation round.
//
// A small blocking allreduce used to cross the links three times: REQUESTS
// (worker -> 0), RESPONSES (0 -> worker), then the direct allreduce's
// header-and-data exchange (allreduce_direct.cc). Folding removes the third
// crossing. Protocol (an addition to control.h's round protocol, never a
// replacement):
//   worker: when a round drains exactly one new entry and it is a host-memory
//     allreduce of the job (no process set, no group) of at most
//     RINGREDUCE_FOLD_BYTES, its REQUESTS carries, besides the usual request,
//     the entry's name and its contribution (the input after prescale, copied
//     at that moment: the caller may not change an input in flight).
//   rank 0: keeps each worker's folded contribution under the tensor's name
//     until a response names the tensor (kExec or kError). A kExec response
//     of that one tensor, every rank contributing (no joined rank), whose
//     every worker folded a contribution of the tensor's size, is folded:
//     rank 0 reduces the contributions exactly as allreduce_direct does (rank
//     order 0..N-1, then finalize_reduction), writes its own result, and the
//     RESPONSES carry the result bytes with the response.
//   barriers: a barrier of the job is folded without contributions: rank 0
//     answers it only once every rank has entered it, which is all it asks.
//   everyone: a folded response is processed like an executed one (counted,
//     cached, handles resolved) except that it runs no collective: a worker
//     copies the result out of the RESPONSES. No rank touches the context's
//     collective sequence for it, so the data streams stay in step.
// Invariants: the result is bitwise the one allreduce_direct computes (same
// inputs, same order, same kernels); whether a response is folded is rank 0's
// decision alone, announced in the response, so no setting needs to agree;
// an entry that could not be folded (one rank late, fused with others, a
// joined rank, a mismatch) runs the ordinary way, and its folded bytes are
// dropped when its response is processed.
#include <cstring>

#include "collectives/collective_util.h"
#include "collectives/reduce_kernels.h"
#include "coordination/engine.h"
#include "coordination/fold.h"

namespace rr {

namespace {

bool foldable_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAverage:
    case ReduceOp::kMin:
    case ReduceOp::kMax:
    case ReduceOp::kProduct: return true;
    case ReduceOp::kAdasum: return false;  // not element-wise: allreduce_adasum.cc
  }
  return false;
}

}  // namespace

bool foldable_meta(const RequestMeta& m, size_t limit) {
  return m.kind == CollKind::kAllreduce && m.members.empty() && m.group.empty() && m.device < 0 &&
         foldable_op(m.op) && limit > 0 && m.bytes() <= limit;
}

std::vector<uint8_t> fold_contribution(const Entry& e) {
  const RequestMeta& m = e.meta;
  std::vector<uint8_t> bytes(m.bytes());
  if (!bytes.empty()) std::memcpy(bytes.data(), e.in, bytes.size());
  if (m.prescale != 1.0)
    apply_prescale(bytes.data(), static_cast<size_t>(num_elements(m.shape)), m.dtype, m.prescale);
  return bytes;
}

std::vector<uint8_t> fold_reduce(const RequestMeta& m, std::vector<uint8_t> acc,
                                 const std::vector<const std::vector<uint8_t>*>& rest, int size) {
  const size_t count = static_cast<size_t>(num_elements(m.shape));
  for (const std::vector<uint8_t>* c : rest)
    reduce_into(acc.data(), c->data(), count, m.dtype, m.op);
  finalize_reduction(acc.data(), count, m.dtype, m.op, m.postscale, size);
  return acc;
}

// Worker: the folds section of REQUESTS (u32 count, then name and bytes each).
void Engine::encode_folds(const std::vector<Entry>& fresh, ByteWriter& w) const {
  const Entry* e = fresh.size() == 1 ? &fresh.front() : nullptr;
  const bool fold = size_ > 1 && e && !e->join && foldable_meta(e->meta, opt_.fold_bytes);
  w.put<uint32_t>(fold ? 1 : 0);
  if (!fold) return;
  w.put_str(e->meta.name);
  w.put_bytes(fold_contribution(*e));
}

// Rank 0: keeps what a worker folded until a response names the tensor.
void Engine::decode_folds(int rank, ByteReader& r) {
  const uint32_t n = r.get<uint32_t>();
  for (uint32_t i = 0; i < n; ++i) {
    std::string name = r.get_str();
    std::vector<uint8_t> bytes = r.get_bytes();
    Folds& f = folds_[name];
    if (f.by_rank.empty()) {
      f.by_rank.resize(size_);
      f.have.assign(size_, 0);
    }
    if (!f.have[rank]) ++f.count;
    f.have[rank] = 1;
    f.by_rank[rank] = std::move(bytes);
  }
}

// Rank 0, after decide(): folds what can be folded, forgets folds of every
// tensor a response settled.
void Engine::fold_responses(std::vector<Response>& rs) {
  for (Response& r : rs) {
    if (r.type != RespType::kExec && r.type != RespType::kError) continue;
    if (r.type == RespType::kExec && r.tensors.size() == 1) fold_one(r);
    for (const RequestMeta& m : r.tensors) folds_.erase(m.name);
  }
}

void Engine::fold_one(Response& r) {
  const RequestMeta& m = r.tensors.front();
  if (m.kind == CollKind::kBarrier) {
    // Rank 0 answers only once every rank has entered: that is the barrier.
    r.folded = opt_.fold_bytes > 0 && m.members.empty() && r.contributors == size_ &&
               pending_.count(m.name) > 0;
    return;
  }
  auto f = folds_.find(m.name);
  auto mine = pending_.find(m.name);
  if (f == folds_.end() || f->second.count != size_ - 1 || mine == pending_.end() ||
      r.contributors != size_ || !foldable_meta(m, opt_.fold_bytes))
    return;
  const size_t bytes = m.bytes();
  for (int w = 1; w < size_; ++w)
    if (f->second.by_rank[w].size() != bytes) return;
  std::vector<const std::vector<uint8_t>*> rest;
  for (int w = 1; w < size_; ++w) rest.push_back(&f->second.by_rank[w]);
  std::vector<uint8_t> out = fold_reduce(m, fold_contribution(mine->second), rest, size_);
  r.folded = true;
  r.result = std::move(out);
}

// Everyone: a folded response's result goes to the caller's buffer.
void Engine::finish_folded(const Response& r) {
  const RequestMeta& m = r.tensors.front();
  if (timeline_ && timeline_->active()) {  // rank 0: its row shows the folded call
    timeline_->end(m.name);                // closes WAIT, which negotiation opened
    timeline_->begin(m.name, cat(coll_name(m.kind), " (folded)"));
    timeline_->end(m.name);
  }
  auto it = pending_.find(m.name);
  if (it == pending_.end())
    throw_error(ErrorKind::kInternal, "rank ", rank_, ": told that ", coll_name(m.kind), " '",
                m.name, "' was folded, which this rank never submitted");
  if (m.kind == CollKind::kBarrier) {
    folded_.fetch_add(1, std::memory_order_relaxed);
    return resolve_names({m.name});
  }
  if (r.result.size() != m.bytes())
    throw_error(ErrorKind::kInternal, "rank ", rank_, ": folded allreduce '", m.name,
                "' came with ", r.result.size(), " bytes where ", m.bytes(), " were due");
  if (!r.result.empty()) std::memcpy(it->second.out, r.result.data(), r.result.size());
  folded_.fetch_add(1, std::memory_order_relaxed);
  resolve_names({m.name});
}

}  // namespace rr
