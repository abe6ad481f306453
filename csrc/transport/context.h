// A Context is one rank's membership in a job: its links to every peer, its
// shared-memory segment and the settings collectives run with. It is built in
// two phases so that any rendezvous can carry the endpoint exchange:
//   Context ctx(options);                 // listen on TCP, pick a shm name
//   bytes mine = ctx.local_info();        // publish this through the store
//   ctx.connect(all_infos);               // build shm rings and TCP mesh
// No process-wide state: N contexts in one process are N independent ranks.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "transport/heartbeat.h"
#include "transport/link.h"
#include "transport/progress.h"
#include "transport/shm/shared_region.h"
#include "transport/shm/shm_segment.h"
#include "transport/stream_choice.h"
#include "transport/tcp/handshake.h"
#include "transport/tcp/socket_util.h"
#include "transport/transports.h"

namespace rr {

// Told by the algorithms when they enter a phase ("RING_REDUCE_SCATTER"...);
// the engine's timeline implements it. Not owned by the Context.
class PhaseObserver {
 public:
  virtual ~PhaseObserver() = default;
  virtual void phase(const char* name) = 0;
};

struct ContextOptions {
  int rank = 0;
  int size = 1;
  std::string secret;              // shared by all ranks of the job (random per job)
  std::string host_id;             // ranks with equal host_id share memory
  std::string transport = "auto";  // RINGREDUCE_TRANSPORT (transports.h)
  std::string bind_addr = "0.0.0.0";
  double connect_timeout_s = 60;  // RINGREDUCE_CONNECT_TIMEOUT_SECONDS
  double timeout_s = 1800;        // RINGREDUCE_TIMEOUT_SECONDS
  // RINGREDUCE_LINK_TIMEOUT_SECONDS: a TCP peer that acknowledges nothing (or
  // is unheard while idle) this long is lost (tune_data_socket); 0 = never.
  double link_timeout_s = 30;
  // Heartbeats (heartbeat.h): a rank unheard for stall_check_s is named in a
  // warning (RINGREDUCE_STALL_CHECK_SECONDS), for peer_timeout_s it fails the
  // job (RINGREDUCE_PEER_TIMEOUT_SECONDS); 0 turns either off.
  double stall_check_s = 60;
  double peer_timeout_s = 120;
  double spin_us = 1000;                // RINGREDUCE_SPIN_US
  uint32_t shm_slots = 8;               // RINGREDUCE_SHM_SLOTS
  uint64_t shm_slot_bytes = 256 << 10;  // RINGREDUCE_SHM_SLOT_BYTES
  // RINGREDUCE_RING_SLICE_BYTES: chained rings run slice by slice from here
  // (ring_pipeline.h); a multiple of shm_slot_bytes, equal on all ranks.
  uint64_t ring_slice_bytes = 1 << 20;
  uint64_t small_bytes = 64 << 10;     // RINGREDUCE_SMALL_BYTES: direct path at or below
  uint64_t streaming_bytes = 8 << 20;  // RINGREDUCE_STREAMING_BYTES: bypass caches from here
  // RINGREDUCE_SHARED_MIN_BYTES: allreduces over shared buffers read the peers'
  // memory from here on (below, its two barriers cost more than the ring).
  uint64_t shared_min_bytes = 4 << 20;
  // RINGREDUCE_SHM_STREAM_SEND_BYTES (0 = off): on by default because the
  // VMs we measured on spend long stretches in a mode where cache-to-cache
  // hand-over is 4x slower (README, "Benchmarks").
  uint64_t shm_stream_send_bytes = 1 << 20;
  StreamMode shm_stream_mode = StreamMode::kAuto;  // RINGREDUCE_SHM_STREAM_SEND
  // RINGREDUCE_HIERARCHICAL_ALLREDUCE: 1 on, 0 off, -1 (unset) automatic
  // (allreduce_hierarchical.cc; the ranks agree through the header).
  int hierarchical = -1;
  // RINGREDUCE_HIERARCHICAL_ALLGATHER: 1 on, 0 off (default; ranks agree on it
  // at start-up: allgather_hierarchical.cc).
  int hierarchical_allgather = 0;
};

// Reads RINGREDUCE_* settings over the defaults.
ContextOptions options_from_env(int rank, int size, const std::string& secret);

struct PeerInfo {
  int rank = -1;
  int pid = 0;
  std::string host_id;
  std::string addr;
  int port = 0;
  std::string shm_name;
};

class Context {
 public:
  explicit Context(ContextOptions options);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  std::string local_info() const;
  void connect(const std::vector<std::string>& infos);
  void close();

  int rank() const { return opt_.rank; }
  int size() const { return opt_.size; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  int cross_rank() const { return cross_rank_; }
  int cross_size() const { return cross_size_; }
  // Global ranks of each host, hosts in order of their lowest rank.
  const std::vector<std::vector<int>>& hosts() const { return hosts_; }
  const ContextOptions& options() const { return opt_; }
  // The autotuner's choice of RINGREDUCE_HIERARCHICAL_ALLREDUCE (-1, 0, 1),
  // set by the thread that runs the collectives, between them.
  void set_hierarchical(int setting) { opt_.hierarchical = setting; }
  const std::vector<PeerInfo>& peers() const { return peers_; }
  Link& link(int peer);
  const ProgressSettings& progress() const { return progress_; }

  // Collectives number their calls so ranks can tell they are in step.
  uint64_t next_seq() { return seq_++; }
  // Scratch that persists between calls (MPI loses big messages to page
  // faults on fresh temporaries). Grows, never shrinks.
  uint8_t* scratch(size_t slot, size_t bytes);

  // After a transport failure the streams are out of step: refuse further use,
  // and tell every peer so that none of them waits for this rank.
  void mark_broken(const std::string& why);
  // This rank is shutting down (any thread): waits in progress() end with an error,
  // within one liveness check (100 ms), also the waits of this context's group views.
  void interrupt() { leaving_.store(true); }
  void check_usable() const;

  // Ranks of one host may share memory: an allowed transport does
  // (RINGREDUCE_TRANSPORT), whether or not this job has such peers.
  bool hosts_may_share_memory() const;
  // A buffer the ranks of this host map (shared_region.h): collective over all
  // ranks, in the same order with the same size; nullptr when no allowed
  // transport shares memory, and in a group view.
  std::shared_ptr<SharedRegion> create_shared(size_t bytes);
  std::shared_ptr<SharedRegion> find_shared(const void* p, size_t n, size_t* offset) const {
    return shared_.find(p, n, offset);
  }
  // How many allreduces ran over shared buffers (read from any thread).
  uint64_t shared_allreduces() const { return shared_allreduces_.load(); }
  void count_shared_allreduce() { shared_allreduces_.fetch_add(1); }
  uint64_t hierarchical_allreduces() const { return hierarchical_allreduces_.load(); }
  void count_hierarchical_allreduce() { hierarchical_allreduces_.fetch_add(1); }
  uint64_t hierarchical_allgathers() const { return hierarchical_allgathers_.load(); }
  void count_hierarchical_allgather() { hierarchical_allgathers_.fetch_add(1); }
  // Adasum allreduces (the adasum() entry point), counted on the job's context.
  uint64_t adasum_allreduces() const { return adasum_allreduces_.load(); }
  void count_adasum_allreduce() {
    if (parent_)
      parent_->count_adasum_allreduce();
    else
      adasum_allreduces_.fetch_add(1);
  }

  // A view of some of this job's ranks as a job of its own (context_group.cc):
  // rank() and size() are positions in `members` (global ranks, in ring
  // order, this rank among them) and link(i) is this context's link to
  // members[i], so every algorithm runs on it unchanged. Traffic shares the
  // links: ranks must run the group's work in the same order relative to
  // the rest. A failure inside breaks this whole context. Cached per member
  // list; lives as long as this context stays open.
  Context& group(const std::vector<int>& members);
  // Global rank of a rank of this context (itself unless it is a group view).
  int global_rank(int r) const { return parent_ ? parent_->global_rank(members_[r]) : r; }

  StreamChoice& stream_choice() { return stream_choice_; }
  void set_phase_observer(PhaseObserver* o) { observer_ = o; }
  void phase(const char* name) {
    if (parent_)
      parent_->phase(name);
    else if (observer_)
      observer_->phase(name);
  }

 private:
  Context(Context& parent, std::vector<int> members);  // a group view
  void leave(const std::string& reason);
  void compute_topology();
  friend struct TransportAccess;  // the table's entries connect (transports.cc)
  void choose_transports();
  void add_link(int peer, std::unique_ptr<Link> link);
  void connect_shm(const std::vector<int>& local);
  void connect_tcp(const std::vector<int>& data_peers);
  void accept_tcp(int expect_accepts, const std::vector<bool>& data, const HandshakeParams& hp,
                  Deadline deadline);
  size_t chunk() const { return opt_.shm_slot_bytes; }  // TCP staging = shm slot
  uint64_t job_id() const;
  std::string shm_prefix() const;  // of every shm object of this job

  ContextOptions opt_;
  ProgressSettings progress_;
  std::atomic<bool> leaving_{false};  // interrupt(); progress_.leaving points here
  std::vector<PeerInfo> peers_;
  std::vector<std::unique_ptr<Link>> links_;
  std::vector<const Transport*> allowed_;  // RINGREDUCE_TRANSPORT's entries, in table order
  std::vector<const Transport*> chosen_;   // by peer (nullptr for this rank)
  std::unique_ptr<Heartbeat> heartbeat_;
  std::vector<std::unique_ptr<ShmSegment>> segments_;  // by local rank; ours included
  Fd listener_;
  int port_ = 0;
  std::string addr_;
  int local_rank_ = 0, local_size_ = 1, cross_rank_ = 0, cross_size_ = 1;
  std::vector<int> local_index_;  // local rank of each global rank on our host, or -1
  uint64_t seq_ = 0;
  std::vector<std::vector<uint8_t>> scratch_;
  std::string broken_;
  bool connected_ = false;
  PhaseObserver* observer_ = nullptr;
  StreamChoice stream_choice_;
  SharedRegistry shared_;
  std::atomic<uint64_t> shared_allreduces_{0};
  std::atomic<uint64_t> hierarchical_allreduces_{0};
  std::atomic<uint64_t> hierarchical_allgathers_{0};
  std::atomic<uint64_t> adasum_allreduces_{0};
  std::vector<std::vector<int>> hosts_;
  Context* parent_ = nullptr;  // set on group views only
  std::vector<int> members_;   // a view's ranks in parent_
  std::map<std::vector<int>, std::unique_ptr<Context>> groups_;
};

}  // namespace rr
