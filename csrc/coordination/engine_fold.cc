// Folded rounds: a small collective finished inside its negotiation round.
//
// A small blocking allreduce used to cross the links three times: REQUESTS
// (worker -> 0), RESPONSES (0 -> worker), then the direct allreduce's
// header-and-data exchange (allreduce_direct.cc); a small broadcast or
// allgather likewise. Folding removes the third crossing. Protocol (an
// addition to control.h's round protocol, never a replacement):
//   worker: when a round drains exactly one new entry and it is a host-memory
//     allreduce, broadcast or allgather of the job (no process set, no group)
//     of at most RINGREDUCE_FOLD_BYTES, its REQUESTS carries, besides the
//     usual request, the entry's name and its contribution (fold.h: for an
//     allreduce the input after prescale, for a broadcast the root's buffer
//     and nothing from the others, for an allgather its rows; copied at that
//     moment: the caller may not change an input in flight).
//   rank 0: keeps each worker's folded contribution under the tensor's name
//     until a response names the tensor (kExec or kError). A kExec response
//     of that one tensor, every rank contributing (no joined rank), whose
//     every worker folded a contribution of the right size (an allreduce's
//     size, the root's buffer or nothing, whole rows of at most the limit),
//     is folded: rank 0 combines the contributions as the collective would
//     (fold_result), writes its own result, and the RESPONSES carry the
//     result bytes with the response.
//   barriers: a barrier of the job is folded without contributions: rank 0
//     answers it only once every rank has entered it, which is all it asks.
//   everyone: a folded response is processed like an executed one (counted,
//     cached, handles resolved) except that it runs no collective: a worker
//     copies the result out of the RESPONSES. No rank touches the context's
//     collective sequence for it, so the data streams stay in step.
// Invariants: the result is bitwise the one the collective computes (same
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

size_t allgather_row_bytes(const RequestMeta& m) {
  if (m.shape.empty()) return 0;
  size_t row = dtype_size(m.dtype);
  for (size_t d = 1; d < m.shape.size(); ++d) row *= static_cast<size_t>(m.shape[d]);
  return row;
}

bool foldable_meta(const RequestMeta& m, size_t limit) {
  // An allgather of empty rows gives no row count to build its result's shape from.
  const bool kind = (m.kind == CollKind::kAllreduce && foldable_op(m.op)) ||
                    m.kind == CollKind::kBroadcast ||
                    (m.kind == CollKind::kAllgather && allgather_row_bytes(m) > 0);
  return kind && m.members.empty() && m.group.empty() && m.device < 0 && limit > 0 &&
         m.bytes() <= limit;
}

std::vector<uint8_t> fold_contribution(const Entry& e, int rank) {
  const RequestMeta& m = e.meta;
  if (m.kind == CollKind::kBroadcast && rank != m.root) return {};
  std::vector<uint8_t> bytes(m.bytes());
  if (!bytes.empty()) std::memcpy(bytes.data(), e.in, bytes.size());
  if (m.kind == CollKind::kAllreduce && m.prescale != 1.0)
    apply_prescale(bytes.data(), static_cast<size_t>(num_elements(m.shape)), m.dtype, m.prescale);
  return bytes;
}

bool contribution_fits(const RequestMeta& m, int rank, size_t bytes) {
  if (m.kind == CollKind::kBroadcast && rank != m.root) return bytes == 0;
  return bytes == m.bytes();
}

std::vector<uint8_t> fold_result(const RequestMeta& m, std::vector<uint8_t> first,
                                 const std::vector<const std::vector<uint8_t>*>& rest, int size) {
  if (m.kind == CollKind::kBroadcast) return m.root == 0 ? first : *rest.at(m.root - 1);
  if (m.kind == CollKind::kAllgather) {
    for (const std::vector<uint8_t>* c : rest) first.insert(first.end(), c->begin(), c->end());
    return first;
  }
  const size_t count = static_cast<size_t>(num_elements(m.shape));
  for (const std::vector<uint8_t>* c : rest)
    reduce_into(first.data(), c->data(), count, m.dtype, m.op);
  finalize_reduction(first.data(), count, m.dtype, m.op, m.postscale, size);
  return first;
}

// Worker: the folds section of REQUESTS (u32 count, then name and bytes each).
void Engine::encode_folds(const std::vector<Entry>& fresh, ByteWriter& w) const {
  const Entry* e = fresh.size() == 1 ? &fresh.front() : nullptr;
  const bool fold = size_ > 1 && e && !e->join && foldable_meta(e->meta, opt_.fold_bytes);
  w.put<uint32_t>(fold ? 1 : 0);
  if (!fold) return;
  w.put_str(e->meta.name);
  w.put_bytes(fold_contribution(*e, rank_));
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
      r.contributors != size_ || !foldable_meta(m, opt_.fold_bytes) ||
      !foldable_meta(mine->second.meta, opt_.fold_bytes))  // an allgather's rows may differ
    return;
  size_t total = mine->second.meta.bytes();
  for (int w = 1; w < size_; ++w) {
    if (!folded_part_fits(m, w, f->second.by_rank[w].size())) return;
    total += f->second.by_rank[w].size();
  }
  // An allgather's result goes to every worker: at most twice the limit keeps
  // rank 0's sending linear in the ranks (a pair's result always fits, which
  // a promise relies on).
  if (m.kind == CollKind::kAllgather && total > 2 * opt_.fold_bytes) return;
  std::vector<const std::vector<uint8_t>*> rest;
  for (int w = 1; w < size_; ++w) rest.push_back(&f->second.by_rank[w]);
  r.result = fold_result(m, fold_contribution(mine->second, 0), rest, size_);
  r.folded = true;
}

// Rank 0: whether worker `w` folded what `m` (the response's metadata, as one
// rank submitted it) asks of it: an allgather's rows may differ per rank, so
// whole rows within the limit.
bool Engine::folded_part_fits(const RequestMeta& m, int w, size_t bytes) const {
  if (m.kind != CollKind::kAllgather) return contribution_fits(m, w, bytes);
  return bytes <= opt_.fold_bytes && bytes % allgather_row_bytes(m) == 0;
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
  deliver_folded(m, it->second, r.result);
  folded_.fetch_add(1, std::memory_order_relaxed);
  resolve_names({m.name});
}

// A folded result into the caller's buffer, or, for an allgather, into the
// buffer the engine allocates for it (its rows: the result's size / a row's).
void Engine::deliver_folded(const RequestMeta& m, Entry& e, const std::vector<uint8_t>& result) {
  if (m.kind == CollKind::kAllgather) {
    std::vector<int64_t> shape = e.meta.shape;
    const size_t row = allgather_row_bytes(m);  // foldable: not 0
    if (row == 0 || result.size() % row != 0)
      throw_error(ErrorKind::kInternal, "rank ", rank_, ": folded allgather '", m.name,
                  "' came with ", result.size(), " bytes, not whole rows of ", row);
    shape[0] = static_cast<int64_t>(result.size() / row);
    OwnedBuffer out = allocate_owned(shape, m.dtype);
    if (!result.empty()) std::memcpy(out.data.get(), result.data(), result.size());
    e.handle->outputs[e.index] = std::move(out);
    return;
  }
  if (result.size() != m.bytes())
    throw_error(ErrorKind::kInternal, "rank ", rank_, ": folded ", coll_name(m.kind), " '", m.name,
                "' came with ", result.size(), " bytes where ", m.bytes(), " were due");
  if (m.kind == CollKind::kBroadcast && rank_ == m.root) return;  // its buffer holds it
  if (!result.empty()) std::memcpy(e.out, result.data(), result.size());
}

}  // namespace rr
