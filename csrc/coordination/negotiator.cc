#include "coordination/negotiator.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "coordination/fusion.h"
#include "coordination/timeline.h"

namespace rr {

namespace {

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += cat(i ? "," : "", ranks[i]);
  return s;
}

}  // namespace

size_t Negotiator::first_submitted(const Pending& p) {
  for (size_t r = 0; r < p.submitted.size(); ++r)
    if (p.submitted[r]) return r;
  return 0;
}

const RequestMeta& Negotiator::any_meta(const Pending& p) {
  return p.metas[first_submitted(p)];
}

Negotiator::Negotiator(NegotiatorOptions o, Timeline* timeline)
    : opt_(o), timeline_(timeline), joined_(o.size, false) {}

void Negotiator::submit(int rank, RequestMeta m, double now) {
  auto [it, fresh] = table_.try_emplace(m.name);
  Pending& p = it->second;
  if (fresh) {
    p.metas.resize(opt_.size);
    p.submitted.assign(opt_.size, false);
    p.rejected.assign(opt_.size, std::string());
    p.first_seen = p.last_warned = now;
    p.order = next_order_++;
    if (timeline_ && timeline_->active()) timeline_->negotiate_begin(m.name, coll_name(m.kind));
  }
  last_activity_ = std::max(last_activity_, now);
  if (p.submitted[rank]) {  // engines refuse a name in flight twice, not one they refused
    if (!p.rejected[rank].empty()) p.later.push_back({rank, std::move(m), std::string()});
    return;
  }
  p.submitted[rank] = true;
  ++p.count;
  if (timeline_ && timeline_->active()) timeline_->rank_ready(m.name, rank);
  p.metas[rank] = std::move(m);
}

void Negotiator::reject(int rank, RequestMeta m, std::string why, double now) {
  if (why.empty()) why = "(no reason given)";
  auto it = table_.find(m.name);
  if (it != table_.end() && it->second.submitted[rank] && !it->second.rejected[rank].empty()) {
    it->second.later.push_back({rank, std::move(m), std::move(why)});  // the next call's
    return;
  }
  const std::string name = m.name;
  submit(rank, std::move(m), now);
  std::string& slot = table_.at(name).rejected[rank];
  if (slot.empty()) slot = std::move(why);
}

void Negotiator::join(int rank, double now, const std::vector<int32_t>& members) {
  last_activity_ = std::max(last_activity_, now);
  if (!members.empty()) {
    auto& in = set_joins_[members];
    if (std::find(in.begin(), in.end(), rank) == in.end()) in.push_back(rank);
    return;
  }
  if (joined_[rank]) return;
  joined_[rank] = true;
  ++joined_count_;
  last_joined_ = rank;
}

// A tensor some rank submitted just before its join() arrives in the round
// in which the last rank joins: it is ready (the others contribute neutral
// elements) and runs before the join completes, never left behind by it.
// A process set's tensor waits for its members only.
bool Negotiator::ready(const Pending& p) const {
  const RequestMeta& m = any_meta(p);
  for (int r = 0; r < opt_.size; ++r)
    if (!has_joined(m, r) && !p.submitted[r] && m.has_rank(r)) return false;
  return true;
}

bool Negotiator::has_joined(const RequestMeta& m, int rank) const {
  if (joined_[rank]) return true;
  if (m.members.empty() || set_joins_.empty()) return false;
  auto it = set_joins_.find(m.members);
  return it != set_joins_.end() &&
         std::find(it->second.begin(), it->second.end(), rank) != it->second.end();
}

// A process set all of whose members joined: kJoinDone names it (its one
// tensor carries the members) and its join state resets.
void Negotiator::finish_set_joins(std::vector<Response>* out) {
  for (auto it = set_joins_.begin(); it != set_joins_.end();) {
    if (it->second.size() < it->first.size()) {
      ++it;
      continue;
    }
    Response j;
    j.type = RespType::kJoinDone;
    j.last_joined = it->second.back();
    j.tensors.emplace_back();
    j.tensors.back().kind = CollKind::kBarrier;
    j.tensors.back().name = cat("join@", ranks_text(it->first));
    j.tensors.back().members = it->first;
    out->push_back(std::move(j));
    it = set_joins_.erase(it);
  }
}

std::string Negotiator::mismatch(const Pending& p) const {
  const RequestMeta* first = nullptr;
  bool differ = false;
  for (int r = 0; r < opt_.size; ++r) {
    if (!p.submitted[r]) continue;
    if (!first)
      first = &p.metas[r];
    else
      differ |= !compatible(*first, p.metas[r]);
  }
  if (!differ) return "";
  std::map<std::string, std::vector<int>> groups;
  for (int r = 0; r < opt_.size; ++r)
    if (p.submitted[r]) groups[p.metas[r].describe()].push_back(r);
  std::string msg = cat("ranks disagree on tensor '", first->name, "' (every rank must ",
                        "submit a name with the same collective, dtype, shape, op, root and ",
                        "scale factors): ");
  bool lead = true;
  for (const auto& [text, ranks] : groups) {
    msg += cat(lead ? "" : "; ", rank_list(ranks), " called ", text);
    lead = false;
  }
  return msg;
}

std::string Negotiator::rejection(const Pending& p) const {
  std::vector<int> ranks;
  std::string reasons;
  for (int r = 0; r < opt_.size; ++r) {
    if (p.rejected[r].empty()) continue;
    ranks.push_back(r);
    reasons += cat(reasons.empty() ? "" : "; ", p.rejected[r]);
  }
  if (ranks.empty()) return "";
  const RequestMeta& m = any_meta(p);
  return cat(coll_name(m.kind), " '", m.name, "': ", rank_list(ranks),
             " refused this call locally: ", reasons);
}

std::string Negotiator::unsupported_with_joined(const Pending& p) const {
  if (joined_count_ == 0 && set_joins_.empty()) return "";
  const RequestMeta& m = any_meta(p);
  std::vector<int> absent;
  for (int r = 0; r < opt_.size; ++r)
    if (has_joined(m, r) && !p.submitted[r] && m.has_rank(r)) absent.push_back(r);
  if (absent.empty()) return "";
  if (m.kind == CollKind::kBroadcast && !p.submitted[m.global_rank(m.root)])
    return cat(
        "broadcast '", m.name, "': root rank ", m.root,
        m.members.empty() ? "" : cat(" of the process set (rank ", m.global_rank(m.root), ")"),
        " has already joined");
  if (m.kind == CollKind::kAllreduce || m.kind == CollKind::kAllgather ||
      m.kind == CollKind::kBroadcast)
    return "";
  return cat(coll_name(m.kind), " '", m.name, "' cannot run while ", rank_list(absent),
             " joined (only allreduce, allgather and broadcast can)");
}

Response Negotiator::verdict(Pending& p) const {
  Response r;
  r.contributors = p.count;
  std::string why = rejection(p);
  if (why.empty()) why = mismatch(p);
  ErrorKind kind = ErrorKind::kMismatch;
  if (why.empty()) {
    why = unsupported_with_joined(p);
    kind = ErrorKind::kInvalidArgument;
  }
  r.tensors.push_back(std::move(p.metas[first_submitted(p)]));  // p is erased next
  if (!why.empty()) {
    r.type = RespType::kError;
    r.error_kind = kind;
    r.message = why;
  }
  return r;
}

void Negotiator::end_negotiation(const Response& r) const {
  if (!timeline_ || !timeline_->active()) return;
  const std::string& name = r.tensors[0].name;
  timeline_->negotiate_end(name);
  if (r.type == RespType::kError) timeline_->end(name);  // nothing will run
}

// The group tags (grouped_allreduce: name and member count) the ranks submitted p with.
std::vector<std::string> Negotiator::group_tags(const Pending& p) {
  std::vector<std::string> tags;
  for (size_t r = 0; r < p.metas.size(); ++r)
    if (p.submitted[r] && !p.metas[r].group.empty() &&
        std::find(tags.begin(), tags.end(), p.metas[r].group) == tags.end())
      tags.push_back(p.metas[r].group);
  return tags;
}

// A grouped call whose member failed (ranks grouped different tensors, or different
// numbers of them) fails as a whole: its members that not every rank submitted will
// never be ready, so they fail too, on the ranks that have them. A rank submits all
// members of a group in one message, so none of them can still be on its way.
void Negotiator::fail_groups(const std::map<std::string, std::string>& groups,
                             std::vector<Response>* out, std::vector<Pending::Later>* later) {
  if (groups.empty()) return;
  std::vector<std::pair<uint64_t, decltype(table_)::iterator>> orphans;
  for (auto it = table_.begin(); it != table_.end(); ++it)
    for (const std::string& t : group_tags(it->second))
      if (groups.count(t)) {
        orphans.emplace_back(it->second.order, it);
        break;
      }
  std::sort(orphans.begin(), orphans.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [order, it] : orphans) {
    Pending& p = it->second;
    Response r;
    r.type = RespType::kError;
    r.error_kind = ErrorKind::kMismatch;
    r.contributors = p.count;
    for (const std::string& t : group_tags(p))
      if (r.message.empty() && groups.count(t)) r.message = groups.at(t);
    r.tensors.push_back(std::move(p.metas[first_submitted(p)]));
    for (Pending::Later& l : p.later) later->push_back(std::move(l));
    table_.erase(it);
    end_negotiation(r);
    out->push_back(std::move(r));
  }
}

// The calls that waited for a refused instance of their name to be decided
// (Pending::later) start the next instance, in the order they came.
void Negotiator::replay(std::vector<Pending::Later>& later, double now) {
  for (Pending::Later& l : later) {
    if (l.why.empty())
      submit(l.rank, std::move(l.meta), now);
    else
      reject(l.rank, std::move(l.meta), std::move(l.why), now);
  }
}

std::vector<Response> Negotiator::decide(double now) {
  std::vector<Response> ready_list;
  for (;;) {  // again while a decided instance's later calls make the next one ready
    // Iterators stay valid while other entries are erased (unordered_map).
    std::vector<std::pair<uint64_t, decltype(table_)::iterator>> done;
    for (auto it = table_.begin(); it != table_.end(); ++it)
      if (ready(it->second)) done.emplace_back(it->second.order, it);
    if (done.empty()) break;
    std::sort(done.begin(), done.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<Pending::Later> later;
    std::map<std::string, std::string> failed_groups;  // group tag -> why
    for (auto& [order, it] : done) {
      std::vector<std::string> tags = group_tags(it->second);
      ready_list.push_back(verdict(it->second));
      if (ready_list.back().type == RespType::kError)
        for (std::string& t : tags) failed_groups.emplace(std::move(t), ready_list.back().message);
      for (Pending::Later& l : it->second.later) later.push_back(std::move(l));
      table_.erase(it);
      end_negotiation(ready_list.back());
    }
    fail_groups(failed_groups, &ready_list, &later);
    if (later.empty()) break;
    replay(later, now);
  }
  std::vector<Response> out = plan_fusion(std::move(ready_list), opt_.fusion_threshold);
  if (joined_count_ == opt_.size) {
    Response j;
    j.type = RespType::kJoinDone;
    j.last_joined = last_joined_;
    out.push_back(j);
    joined_.assign(opt_.size, false);
    joined_count_ = 0;
    last_joined_ = -1;
  }
  if (!set_joins_.empty()) finish_set_joins(&out);
  stall_report(now, &out);
  return out;
}

std::string Negotiator::missing_ranks(const Pending& p) const {
  std::vector<int> have, miss;  // a joined rank is not missing: it will contribute zeros
  const RequestMeta& m = any_meta(p);
  for (int r = 0; r < opt_.size; ++r)
    if (p.submitted[r] || (!has_joined(m, r) && m.has_rank(r)))
      (p.submitted[r] ? have : miss).push_back(r);
  return cat("submitted by ", rank_list(have), ", missing on ", rank_list(miss));
}

void Negotiator::stall_report(double now, std::vector<Response>* out) {
  if (opt_.stall_check_s <= 0 && opt_.stall_shutdown_s <= 0) return;
  std::vector<std::pair<uint64_t, std::string>> lines;
  bool fatal = false;
  for (auto& [name, p] : table_) {
    const double age = now - p.first_seen;
    const bool fail = opt_.stall_shutdown_s > 0 && age >= opt_.stall_shutdown_s;
    const bool warn = opt_.stall_check_s > 0 && now - p.last_warned >= opt_.stall_check_s;
    if (!fail && !warn) continue;
    fatal |= fail;
    p.last_warned = now;
    lines.emplace_back(p.order, cat("'", name, "' (", coll_name(any_meta(p).kind), ") ",
                                    missing_ranks(p), ", for ", std::floor(age * 10) / 10, " s"));
  }
  fatal |= join_stall(now, &lines);
  if (lines.empty()) return;
  std::sort(lines.begin(), lines.end());
  Response r;
  r.type = fatal ? RespType::kFatal : RespType::kStallWarning;
  r.error_kind = ErrorKind::kTimeout;
  r.message =
      "stalled tensors (some ranks submitted them, others did not; every rank must "
      "submit the same tensors, and a rank that ran out of data should call join()): ";
  for (size_t i = 0; i < lines.size(); ++i) r.message += cat(i ? "; " : "", lines[i].second);
  if (fatal)
    r.message += cat(". Stopping: RINGREDUCE_STALL_SHUTDOWN_SECONDS=", opt_.stall_shutdown_s);
  out->push_back(r);
}

// Some ranks joined, nothing is pending and nobody has submitted anything for
// a while: the ranks that have not joined are stuck (or forgot to join), and
// the joined ones would wait forever. Tensor stalls cover the other cases.
bool Negotiator::join_stalled() const {
  return joined_count_ > 0 && joined_count_ < opt_.size && table_.empty();
}

bool Negotiator::join_stall(double now, std::vector<std::pair<uint64_t, std::string>>* lines) {
  if (!join_stalled()) return false;
  const double idle = now - last_activity_;
  const bool fail = opt_.stall_shutdown_s > 0 && idle >= opt_.stall_shutdown_s;
  const bool warn =
      opt_.stall_check_s > 0 && now - std::max(last_activity_, join_warned_) >= opt_.stall_check_s;
  if (!fail && !warn) return false;
  join_warned_ = now;
  std::vector<int> in, out;
  for (int r = 0; r < opt_.size; ++r) (joined_[r] ? in : out).push_back(r);
  lines->emplace_back(UINT64_MAX, cat("join(): ", rank_list(in), " joined; ", rank_list(out),
                                      " neither joined nor submitted anything for ",
                                      std::floor(idle * 10) / 10, " s"));
  return fail;
}

double Negotiator::next_deadline() const {
  double t = std::numeric_limits<double>::infinity();
  if (join_stalled()) {
    if (opt_.stall_check_s > 0) t = std::max(last_activity_, join_warned_) + opt_.stall_check_s;
    if (opt_.stall_shutdown_s > 0) t = std::min(t, last_activity_ + opt_.stall_shutdown_s);
  }
  for (const auto& [name, p] : table_) {
    if (opt_.stall_check_s > 0) t = std::min(t, p.last_warned + opt_.stall_check_s);
    if (opt_.stall_shutdown_s > 0) t = std::min(t, p.first_seen + opt_.stall_shutdown_s);
  }
  return t;
}

}  // namespace rr
