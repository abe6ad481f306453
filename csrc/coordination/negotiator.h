// The coordinator's negotiation state machine (runs on rank 0 only). Ranks
// submit tensors in any order; a tensor is ready once every rank that has not
// joined has submitted it. Per tensor:
//
//   absent --first submit--> pending --all non-joined ranks--> ready --> out
//                               |  (stall: warn after stall_check_s,
//                               |   fail the job after stall_shutdown_s)
//
// decide() turns ready tensors into responses in the order the coordinator
// first saw them: an exec response when all submissions are compatible, an
// error response naming what each rank sent when not. Then fusion planning
// (fusion.h), then join completion (every rank joined -> kJoinDone, the set
// resets; likewise per process set for join(process_set=): its tensors wait
// for its members that have not joined, and once all joined a kJoinDone
// naming the set resets it), then stall reports (also for a join() that the other ranks never
// match while nothing else happens). Pure logic: no I/O, time passed in, so the
// unit tests feed it canned requests.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "coordination/request.h"

namespace rr {

class Timeline;

struct NegotiatorOptions {
  int size = 1;
  uint64_t fusion_threshold = 256ULL << 20;
  double stall_check_s = 60;    // 0: never warn
  double stall_shutdown_s = 0;  // 0: never fail
};

class Negotiator {
 public:
  explicit Negotiator(NegotiatorOptions o, Timeline* timeline = nullptr);

  // By value: a request decoded from the wire is moved in, not copied.
  void submit(int rank, RequestMeta m, double now);
  // `members`: the process set joined (empty: the whole job).
  void join(int rank, double now, const std::vector<int32_t>& members = {});
  // `rank` refused its own call under m.name (kind and name are all m holds)
  // because it failed that rank's checks; its caller already got the error.
  // The name counts as submitted by `rank`, so once the other ranks submit it
  // too they get an error response naming `rank` and `why`, as for a mismatch.
  void reject(int rank, RequestMeta m, std::string why, double now);
  std::vector<Response> decide(double now);
  // When decide() should next run to report a stall (+inf: nothing pending).
  double next_deadline() const;
  size_t pending() const { return table_.size(); }
  // The autotuner's choice, for the responses decided from now on.
  void set_fusion_threshold(uint64_t bytes) { opt_.fusion_threshold = bytes; }
  // Nothing pending and nobody joined: decide() on one ready tensor yields
  // exactly that tensor's response (engine_pair.cc relies on it).
  bool quiet() const { return table_.empty() && joined_count_ == 0 && set_joins_.empty(); }

 private:
  struct Pending {
    std::vector<RequestMeta> metas;  // by rank, valid where submitted
    std::vector<bool> submitted;
    std::vector<std::string> rejected;  // by rank: why it refused its call, or ""
    int count = 0;
    double first_seen = 0;
    double last_warned = 0;
    uint64_t order = 0;
    // Calls of this name by a rank that refused this one: an engine lets a name
    // it refused locally be used again at once, so these belong to the name's
    // next instance and are submitted (or refused) again once this one is decided.
    struct Later {
      int rank;
      RequestMeta meta;
      std::string why;  // a refusal's reason; "" for a submission
    };
    std::vector<Later> later;
  };
  void replay(std::vector<Pending::Later>& later, double now);
  static std::vector<std::string> group_tags(const Pending& p);
  void fail_groups(const std::map<std::string, std::string>& groups, std::vector<Response>* out,
                   std::vector<Pending::Later>* later);
  void end_negotiation(const Response& r) const;
  static size_t first_submitted(const Pending& p);
  static const RequestMeta& any_meta(const Pending& p);
  bool ready(const Pending& p) const;
  bool has_joined(const RequestMeta& m, int rank) const;  // the job, or m's set
  void finish_set_joins(std::vector<Response>* out);
  Response verdict(Pending& p) const;  // moves one of p's metas into the response
  std::string mismatch(const Pending& p) const;
  std::string rejection(const Pending& p) const;
  std::string unsupported_with_joined(const Pending& p) const;
  void stall_report(double now, std::vector<Response>* out);
  std::string missing_ranks(const Pending& p) const;
  bool join_stalled() const;
  bool join_stall(double now, std::vector<std::pair<uint64_t, std::string>>* lines);

  NegotiatorOptions opt_;
  Timeline* timeline_;
  std::unordered_map<std::string, Pending> table_;
  std::vector<bool> joined_;
  int joined_count_ = 0;
  int last_joined_ = -1;
  // join(process_set=): per set, its members (global ranks) that joined, in order.
  std::map<std::vector<int32_t>, std::vector<int32_t>> set_joins_;
  uint64_t next_order_ = 0;
  double last_activity_ = 0;  // latest submit or join, for join stalls
  double join_warned_ = 0;
};

}  // namespace rr
