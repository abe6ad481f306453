// Paired rounds: in a two-rank job a small repeated allreduce, broadcast,
// allgather or barrier finishes in one crossing of the link, as MPI's
// exchange does; and holds,
// which keep a round from starting before the call that would complete it.
//
// Why. A folded round (engine_fold.cc) still crosses twice for the worker:
// its REQUESTS carries its contribution to rank 0, the RESPONSES carry the
// result back. In a two-rank job rank 0's POLL crosses the other way at the
// same time, so it can carry rank 0's contribution, and then each side holds
// both. Protocol (an addition to control.h's round protocol):
//   solo: a REQUESTS payload of rank s is solo for metadata M when it
//     requests one tensor, whose metadata (by cache bit or in full) equals M,
//     and nothing else (no join, refusal or process-set join) and carries
//     that tensor's folded contribution, of the size rank s contributes
//     (fold.h; a job barrier has none). solo_for() is the one predicate both
//     ranks apply to the same bytes, so they cannot disagree on it.
//   rank 0, round k of a two-rank job: when the round drained exactly one
//     entry T, foldable (fold.h) or a job barrier, nothing else is pending
//     in the negotiator, nobody has joined, nothing was refused, and the
//     worker's REQUESTS(k) has not arrived, POLL(k) carries a promise: T's
//     metadata and rank 0's contribution.
//   worker: if its REQUESTS(k) is solo for the promise's metadata, it
//     combines rank 0's contribution and its own (fold_result, as fold_one),
//     processes the response [T, folded] and ends round k without reading a
//     RESPONSES(k).
//   rank 0: if the worker's REQUESTS(k) is solo for its promise, decide()
//     yields exactly [T] (T is ready and nothing else is pending), folded as
//     engine_fold.cc does; it processes that and sends no RESPONSES(k).
//     Otherwise RESPONSES(k) is sent and read as always; the promise is void.
// Holds. When one side's round starts before the other side's call it ends
// empty, and the call waits for another round: three crossings. So, for up
// to RINGREDUCE_SPIN_US after it arrives:
//   rank 0 with no local work does not start a round for workers' REQUESTS
//     that are each solo for a tensor it has not submitted; it reads them
//     ahead (early_) and the round its own call starts uses them;
//   a worker with no local work does not answer a POLL that carries a
//     promise; it reads it ahead and its own call's round answers it.
// After the hold the round runs as it would have: a rank busy computing
// delays the other's round by at most RINGREDUCE_SPIN_US.
// Invariants: every rank processes the same responses in the same order (the
// paired one, or RESPONSES(k)), so response caches and data streams stay in
// step; the result is bitwise the folded one; whether round k is paired
// follows from round k's two messages alone; reading a message ahead never
// reorders a stream (a worker sends nothing after REQUESTS(k) until round k
// ends; rank 0 sends nothing unprompted but POLL).
#include <algorithm>
#include <cstdint>
#include <optional>

#include "coordination/engine.h"
#include "coordination/fold.h"

namespace rr {

namespace {

// By kind alone: solo() must not depend on a rank's own settings, or two ranks
// with different RINGREDUCE_FOLD_BYTES could judge one message differently. A
// folded contribution in the message shows the sender's limit allowed it.
bool pairable_kind(const RequestMeta& m) {
  if (m.kind == CollKind::kBarrier) return m.members.empty();
  return foldable_meta(m, SIZE_MAX);
}

}  // namespace

std::optional<RequestMeta> Engine::solo(const std::vector<uint8_t>& requests, int sender) const {
  ByteReader r(requests.data(), requests.size());
  if (r.get<uint8_t>() != 0) return std::nullopt;  // join
  const std::vector<uint8_t> bits = r.get_bytes();
  std::optional<RequestMeta> m;
  for (size_t byte = 0; byte < bits.size(); ++byte) {
    if (!bits[byte]) continue;  // a cache of 1024 ids is 128 bytes, mostly zero
    if (m || (bits[byte] & (bits[byte] - 1))) return std::nullopt;
    m = cache_.at(static_cast<uint32_t>(byte * 8 + __builtin_ctz(bits[byte])));
  }
  const uint32_t full = r.get<uint32_t>();
  if (full + (m ? 1 : 0) != 1) return std::nullopt;
  if (full == 1) m = RequestMeta::read(r);
  if (r.get<uint32_t>() != 0 || r.get<uint32_t>() != 0) return std::nullopt;  // refusals, sets
  if (!pairable_kind(*m)) return std::nullopt;
  const uint32_t folds = r.get<uint32_t>();
  if (m->kind == CollKind::kBarrier) return folds == 0 ? m : std::nullopt;
  if (folds != 1 || r.get_str() != m->name || !contribution_fits(*m, sender, r.get_bytes().size()))
    return std::nullopt;
  return m;
}

// Rank 0, before its fresh entries reach the negotiator: POLL(k)'s payload,
// a promise (the entry's metadata, then its contribution) or nothing.
std::vector<uint8_t> Engine::promise_for(const std::vector<Entry>& fresh) const {
  if (size_ != 2 || !opt_.paired_rounds || fresh.size() != 1 || early_[1] || joined_ ||
      !joined_sets_.empty() || !rejections_.empty() || !negotiator_->quiet())
    return {};
  const Entry& e = fresh.front();
  if (e.join || !pairable_kind(e.meta) || opt_.fold_bytes == 0 || e.meta.bytes() > opt_.fold_bytes)
    return {};
  ByteWriter w;
  e.meta.write(w);
  w.put_bytes(e.meta.kind == CollKind::kBarrier ? std::vector<uint8_t>() : fold_contribution(e, 0));
  return std::move(w.bytes());
}

bool Engine::solo_for(const std::vector<uint8_t>& requests, int sender,
                      const std::vector<uint8_t>& promise) const {
  if (promise.empty()) return false;
  ByteReader r(promise.data(), promise.size());
  const std::optional<RequestMeta> m = solo(requests, sender);
  return m && *m == RequestMeta::read(r);
}

// Rank 0: the worker's REQUESTS(k) was solo for the promise, and decide()
// folded the one response it had to give.
void Engine::finish_paired_coordinator(const std::vector<Response>& rs) {
  const bool one = rs.size() == 1 && rs.front().type == RespType::kExec &&
                   rs.front().tensors.size() == 1 && rs.front().folded;
  if (!one) {
    std::string names;
    for (const Response& r : rs)
      for (const RequestMeta& m : r.tensors)
        names += cat(names.empty() ? "" : ", ", "'", m.name, "'");
    throw_error(ErrorKind::kInternal, "rank ", rank_, ": negotiation round ", round_,
                " was promised to rank 1 as one folded call, but rank 0 decided ", rs.size(),
                " responses (", names, ")");
  }
  paired_.fetch_add(1, std::memory_order_relaxed);
  process(rs);
}

// Worker: round k ends here when POLL(k) promised the one tensor that this
// rank's REQUESTS(k) announced.
bool Engine::finish_paired_worker(const CtrlMessage& poll, const std::vector<uint8_t>& requests) {
  if (!solo_for(requests, rank_, poll.payload)) return false;
  ByteReader r(poll.payload.data(), poll.payload.size());
  Response resp;
  resp.type = RespType::kExec;
  resp.contributors = size_;
  resp.folded = true;
  resp.tensors.push_back(RequestMeta::read(r));
  std::vector<uint8_t> theirs = r.get_bytes();
  const RequestMeta& m = resp.tensors.front();
  if (m.kind != CollKind::kBarrier) {
    auto mine = pending_.find(m.name);
    if (mine == pending_.end() || !contribution_fits(m, 0, theirs.size()))
      throw_error(ErrorKind::kInternal, "rank ", rank_, ": negotiation round ", round_,
                  ": rank 0 promised ", coll_name(m.kind), " '", m.name, "' with ", theirs.size(),
                  " bytes, which this rank's request does not match");
    const std::vector<uint8_t> own = fold_contribution(mine->second, rank_);
    resp.result = fold_result(m, std::move(theirs), {&own}, size_);
  }
  paired_.fetch_add(1, std::memory_order_relaxed);
  process({resp});
  return true;
}

// Whether messages that arrived should start a round now. Each is read ahead
// whole into early_; a round takes them from there (take_early).
bool Engine::arrived() {
  bool any = false;
  for (int p = rank_ == 0 ? 1 : 0; p < (rank_ == 0 ? size_ : 1); ++p) {
    if (!early_[p] && ctrl_.try_header(p)) {
      auto what = [this] { return cat("negotiation round ", round_, " (read ahead)"); };
      early_[p] = std::make_unique<CtrlMessage>(std::move(ctrl_.receive({p}, what).at(0)));
      if (rank_ == 0) {  // judged once: arrived() runs on every turn of a wait
        const std::optional<RequestMeta> m = solo(early_[p]->payload, p);
        early_solo_[p] = m ? m->name : std::string();
      }
      if (!holding_) hold_until_ = now() + ctx_->progress().spin_seconds;
      holding_ = true;
    }
    any |= early_[p] != nullptr;
  }
  if (!any) return false;
  if (has_work_.load() || now() >= hold_until_ || joined_) return true;  // joined: ready now
  for (int p = 0; p < size_; ++p) {
    if (!early_[p]) continue;
    if (rank_ != 0) return early_[p]->payload.empty();  // a POLL without a promise
    if (early_solo_[p].empty() || pending_.count(early_solo_[p])) return true;
  }
  return false;
}

std::unique_ptr<CtrlMessage> Engine::take_early(int peer) {
  std::unique_ptr<CtrlMessage> m = std::move(early_[peer]);
  holding_ = std::any_of(early_.begin(), early_.end(), [](const auto& e) { return e != nullptr; });
  return m;
}

double Engine::hold_deadline() const {
  return holding_ ? hold_until_ : 1e300;
}

}  // namespace rr
