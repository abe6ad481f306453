#include "transport/context.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <thread>

#include "common/env.h"
#include "common/error.h"
#include "common/logging.h"
#include "common/sha256.h"
#include "transport/shm/shm_link.h"
#include "transport/tcp/handshake.h"
#include "transport/tcp/tcp_link.h"

namespace rr {

ContextOptions options_from_env(int rank, int size, const std::string& secret) {
  ContextOptions o;
  o.rank = rank;
  o.size = size;
  o.secret = secret;
  o.transport = env_str("RINGREDUCE_TRANSPORT", o.transport);
  allowed_transports(o.transport);  // refuses an unknown name here, before any connection
  o.bind_addr = env_str("RINGREDUCE_BIND_ADDR", o.bind_addr);
  o.connect_timeout_s = env_double("RINGREDUCE_CONNECT_TIMEOUT_SECONDS", o.connect_timeout_s);
  o.timeout_s = env_double("RINGREDUCE_TIMEOUT_SECONDS", o.timeout_s);
  o.link_timeout_s = env_double("RINGREDUCE_LINK_TIMEOUT_SECONDS", o.link_timeout_s);
  o.stall_check_s = env_double("RINGREDUCE_STALL_CHECK_SECONDS", o.stall_check_s);
  o.peer_timeout_s = env_double("RINGREDUCE_PEER_TIMEOUT_SECONDS", o.peer_timeout_s);
  o.spin_us = env_double("RINGREDUCE_SPIN_US", o.spin_us);
  o.shm_slots = static_cast<uint32_t>(env_int("RINGREDUCE_SHM_SLOTS", o.shm_slots));
  o.shm_slot_bytes = static_cast<uint64_t>(
      env_int("RINGREDUCE_SHM_SLOT_BYTES", static_cast<int64_t>(o.shm_slot_bytes)));
  o.ring_slice_bytes = static_cast<uint64_t>(
      env_int("RINGREDUCE_RING_SLICE_BYTES", static_cast<int64_t>(o.ring_slice_bytes)));
  o.small_bytes =
      static_cast<uint64_t>(env_int("RINGREDUCE_SMALL_BYTES", static_cast<int64_t>(o.small_bytes)));
  o.streaming_bytes = static_cast<uint64_t>(
      env_int("RINGREDUCE_STREAMING_BYTES", static_cast<int64_t>(o.streaming_bytes)));
  o.shared_min_bytes = static_cast<uint64_t>(
      env_int("RINGREDUCE_SHARED_MIN_BYTES", static_cast<int64_t>(o.shared_min_bytes)));
  o.shm_stream_send_bytes = static_cast<uint64_t>(
      env_int("RINGREDUCE_SHM_STREAM_SEND_BYTES", static_cast<int64_t>(o.shm_stream_send_bytes)));
  const std::string stream = env_str("RINGREDUCE_SHM_STREAM_SEND", "auto");
  if (stream == "always")
    o.shm_stream_mode = StreamMode::kAlways;
  else if (stream == "never")
    o.shm_stream_mode = StreamMode::kNever;
  else if (stream != "auto")
    throw_error(ErrorKind::kInvalidArgument, "RINGREDUCE_SHM_STREAM_SEND='", stream,
                "' is not one of auto, always, never");
  o.hierarchical = static_cast<int>(env_int("RINGREDUCE_HIERARCHICAL_ALLREDUCE", -1));
  o.hierarchical_allgather =
      static_cast<int>(env_int("RINGREDUCE_HIERARCHICAL_ALLGATHER", o.hierarchical_allgather));
  if (o.hierarchical_allgather < 0 || o.hierarchical_allgather > 1)
    throw_error(ErrorKind::kInvalidArgument,
                "RINGREDUCE_HIERARCHICAL_ALLGATHER=", o.hierarchical_allgather, " is not 0 or 1");
  if (o.hierarchical < -1 || o.hierarchical > 1)
    throw_error(ErrorKind::kInvalidArgument, "RINGREDUCE_HIERARCHICAL_ALLREDUCE=", o.hierarchical,
                " is not 0 or 1");
  if (o.shm_slots < 2 || o.shm_slot_bytes < 4096 || o.shm_slot_bytes % 4096 != 0)
    throw_error(ErrorKind::kInvalidArgument, "RINGREDUCE_SHM_SLOTS must be >= 2 and ",
                "RINGREDUCE_SHM_SLOT_BYTES a multiple of 4096");
  if (o.ring_slice_bytes < o.shm_slot_bytes || o.ring_slice_bytes % o.shm_slot_bytes != 0)
    throw_error(ErrorKind::kInvalidArgument, "RINGREDUCE_RING_SLICE_BYTES (", o.ring_slice_bytes,
                ") must be a multiple of RINGREDUCE_SHM_SLOT_BYTES (", o.shm_slot_bytes, ")");
  return o;
}

Context::Context(ContextOptions options)
    : opt_(std::move(options)),
      allowed_(allowed_transports(opt_.transport)),
      stream_choice_(opt_.shm_stream_mode) {
  if (opt_.size < 1 || opt_.rank < 0 || opt_.rank >= opt_.size)
    throw_error(ErrorKind::kInvalidArgument, "invalid rank ", opt_.rank, " for world size ",
                opt_.size);
  if (opt_.size > 1 && opt_.secret.size() < 16)
    throw_error(ErrorKind::kInvalidArgument, "the job secret must have at least 16 bytes");
  progress_.rank = opt_.rank;
  progress_.spin_seconds = opt_.spin_us * 1e-6;
  progress_.timeout_seconds = opt_.timeout_s;
  progress_.leaving = &leaving_;
  if (opt_.size > 1) {
    listener_ = listen_tcp(opt_.bind_addr, 0, &port_);
    addr_ = advertised_address();
  }
}

Context::~Context() {
  close();
}

void Context::close() {
  groups_.clear();                     // views borrow our links
  if (heartbeat_) heartbeat_->stop();  // before its sockets and its peers' links close
  progress_.heartbeat = nullptr;
  leave(cat("rank ", opt_.rank, " shut down"));
  progress_.doorbell = nullptr;  // it lived in our segment
  links_.clear();
  segments_.clear();
  listener_.reset();
  connected_ = false;
}

std::string Context::local_info() const {
  std::ostringstream os;
  os << "rank=" << opt_.rank << "\npid=" << getpid() << "\nhost=" << opt_.host_id
     << "\naddr=" << addr_ << "\nport=" << port_ << "\n";
  return os.str();
}

static PeerInfo parse_info(const std::string& text) {
  PeerInfo p;
  std::istringstream is(text);
  std::string line;
  while (std::getline(is, line)) {
    size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    std::string k = line.substr(0, eq), v = line.substr(eq + 1);
    if (k == "rank")
      p.rank = std::stoi(v);
    else if (k == "pid")
      p.pid = std::stoi(v);
    else if (k == "host")
      p.host_id = v;
    else if (k == "addr")
      p.addr = v;
    else if (k == "port")
      p.port = std::stoi(v);
  }
  return p;
}

uint64_t Context::job_id() const {
  auto h = sha256(opt_.secret.data(), opt_.secret.size());
  uint64_t id = 0;
  for (int i = 0; i < 8; ++i) id = (id << 8) | h[i];
  return id;
}

void Context::compute_topology() {
  std::vector<std::string> hosts;  // in order of their lowest rank
  local_index_.assign(opt_.size, -1);
  hosts_.clear();
  local_rank_ = 0;
  local_size_ = 0;
  for (const auto& p : peers_) {
    auto h = std::find(hosts.begin(), hosts.end(), p.host_id);
    if (h == hosts.end()) {
      hosts.push_back(p.host_id);
      hosts_.emplace_back();
      h = hosts.end() - 1;
    }
    hosts_[h - hosts.begin()].push_back(p.rank);
    if (p.host_id == opt_.host_id) {
      if (p.rank == opt_.rank) local_rank_ = local_size_;
      local_index_[p.rank] = local_size_++;
    }
  }
  cross_size_ = static_cast<int>(hosts.size());
  cross_rank_ =
      static_cast<int>(std::find(hosts.begin(), hosts.end(), opt_.host_id) - hosts.begin());
}

// Walks the allowed entries of the table for every peer (protocol in
// transports.h); both ends of a link choose alike from the same records.
void Context::choose_transports() {
  chosen_.assign(opt_.size, nullptr);
  const PeerInfo& self = peers_[opt_.rank];
  for (int r = 0; r < opt_.size; ++r) {
    if (r == opt_.rank) continue;
    for (const Transport* t : allowed_)
      if (t->can_connect(self, peers_[r], opt_)) {
        chosen_[r] = t;
        break;
      }
    if (!chosen_[r])
      throw_error(ErrorKind::kInvalidArgument, "rank ", opt_.rank,
                  ": RINGREDUCE_TRANSPORT=", opt_.transport,
                  " but no transport it allows reaches rank ", r, " on another host (",
                  peers_[r].host_id, ")");
  }
}

void Context::add_link(int peer, std::unique_ptr<Link> link) {
  link->bind(*chosen_[peer]);
  links_[peer] = std::move(link);
}

void Context::connect(const std::vector<std::string>& infos) {
  if (connected_) throw_error(ErrorKind::kInvalidArgument, "context is already connected");
  if (static_cast<int>(infos.size()) != opt_.size)
    throw_error(ErrorKind::kInvalidArgument, "expected ", opt_.size, " endpoint records, got ",
                infos.size());
  peers_.clear();
  for (int r = 0; r < opt_.size; ++r) {
    peers_.push_back(parse_info(infos[r]));
    if (peers_.back().rank != r)
      throw_error(ErrorKind::kInvalidArgument, "endpoint record ", r, " belongs to rank ",
                  peers_.back().rank);
  }
  compute_topology();
  links_.clear();
  links_.resize(opt_.size);
  std::vector<std::string> hosts;
  for (const auto& p : peers_) hosts.push_back(p.host_id);
  heartbeat_ = std::make_unique<Heartbeat>(
      HeartbeatOptions{opt_.rank, opt_.stall_check_s, opt_.peer_timeout_s, std::move(hosts)});
  choose_transports();
  for (const Transport& t : transport_table()) {
    std::vector<int> mine;
    for (int r = 0; r < opt_.size; ++r)
      if (chosen_[r] == &t) mine.push_back(r);
    t.connect(*this, mine);
  }
  listener_.reset();  // no more strangers can knock once the mesh is complete
  heartbeat_->start();
  progress_.heartbeat = heartbeat_.get();
  connected_ = true;
}

static std::string hex64(uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

std::string Context::shm_prefix() const {
  return "/ringreduce-" + hex64(job_id()) + "-";
}

// The shm entry: one segment per rank holding a ring from every local peer;
// `local` are the peers on this host (all of them, or none).
void Context::connect_shm(const std::vector<int>& local) {
  if (local.empty()) return;
  const std::string prefix = shm_prefix();
  segments_.clear();
  segments_.resize(local_size_);
  segments_[local_rank_] = std::make_unique<ShmSegment>(
      ShmSegment::create(prefix + std::to_string(opt_.rank), opt_.rank,
                         static_cast<uint32_t>(local_size_), opt_.shm_slots, opt_.shm_slot_bytes));
  ShmSegment* mine = segments_[local_rank_].get();
  // Unlinked however this function ends: a rank that fails here (a peer died
  // during initialisation) may exit without destructors, and its segment
  // must not outlive it in /dev/shm (unlink() is idempotent).
  struct UnlinkAtExit {
    ShmSegment* s;
    ~UnlinkAtExit() { s->unlink(); }
  } unlink_mine{mine};
  for (int r : local)
    segments_[local_index_[r]] = std::make_unique<ShmSegment>(
        ShmSegment::open(prefix + std::to_string(r), r, peers_[r].pid, opt_.connect_timeout_s));
  progress_.doorbell = &mine->header()->doorbell;
  // Unlink as soon as every local peer has mapped us: from here on a crash
  // cannot leave anything behind in /dev/shm.
  auto deadline = deadline_in(opt_.connect_timeout_s);
  while (mine->header()->mapped.load() < local.size()) {
    for (int r : local)
      if (!process_alive(peers_[r].pid))
        throw_error(ErrorKind::kPeerLost, "rank ", r, " exited during initialisation");
    if (Clock::now() > deadline)
      throw_error(ErrorKind::kTimeout, "rank ", opt_.rank, ": local peers did not map ",
                  "shared memory within ", opt_.connect_timeout_s, " s");
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  mine->unlink();
  for (int r : local)
    add_link(r, std::make_unique<ShmLink>(
                    r, peers_[r].host_id, peers_[r].pid, mine, segments_[local_index_[r]].get(),
                    static_cast<uint32_t>(local_rank_), static_cast<uint32_t>(local_index_[r]),
                    opt_.shm_stream_send_bytes));
}

bool Context::hosts_may_share_memory() const {
  for (const Transport* t : allowed_)
    if (t->shares_memory) return true;
  return false;
}

// Shared among this host's ranks: every rank's on a one-host job; on several
// hosts each host's (allreduce_shared_hierarchical.cc reads them). None when
// no allowed transport shares memory, nor for a group view.
std::shared_ptr<SharedRegion> Context::create_shared(size_t bytes) {
  if (parent_ || !hosts_may_share_memory()) return nullptr;
  std::vector<SharedPeer> peers;
  for (int r = 0; r < opt_.size; ++r)
    if (r != opt_.rank && chosen_[r]->shares_memory) peers.push_back(SharedPeer{r, peers_[r].pid});
  return shared_.create(shm_prefix(), opt_.rank, opt_.size, peers, bytes, opt_.connect_timeout_s);
}

// The tcp entry: data links to `data_peers` (the lower rank accepts), plus
// one heartbeat connection from every worker to rank 0, whatever carries the
// data (heartbeat.h), so it runs even with no data peers.
void Context::connect_tcp(const std::vector<int>& data_peers) {
  HandshakeParams hp{opt_.secret, job_id(), opt_.rank, opt_.size};
  auto deadline = deadline_in(opt_.connect_timeout_s);
  std::vector<bool> by_socket(opt_.size, false);
  for (int r : data_peers) by_socket[r] = true;
  int expect_accepts = opt_.rank == 0 ? opt_.size - 1 : 0;  // heartbeats
  for (int r = 0; r < opt_.size; ++r) {
    if (r == opt_.rank) continue;
    const bool data = by_socket[r];
    if (r > opt_.rank) {
      expect_accepts += data;
      continue;
    }
    std::string who = cat("rank ", r, " at ", peers_[r].addr, ":", peers_[r].port);
    for (Channel ch : {Channel::kData, Channel::kHeartbeat}) {
      if ((ch == Channel::kData && !data) || (ch == Channel::kHeartbeat && r != 0)) continue;
      Fd fd = connect_until(peers_[r].addr, peers_[r].port, deadline);
      handshake_connect(fd.get(), hp, r, ch, deadline, who);
      if (ch == Channel::kHeartbeat) {
        tune_data_socket(fd.get(), opt_.link_timeout_s);
        heartbeat_->add(r, std::move(fd));
      } else {
        add_link(r, std::make_unique<TcpLink>(r, peers_[r].host_id, std::move(fd), chunk(),
                                              opt_.link_timeout_s));
      }
    }
  }
  accept_tcp(expect_accepts, by_socket, hp, deadline);
}

void Context::accept_tcp(int expect_accepts, const std::vector<bool>& data,
                         const HandshakeParams& hp, Deadline deadline) {
  std::vector<bool> beating(opt_.size, false);
  while (expect_accepts > 0) {
    std::string from;
    Fd fd = accept_until(listener_.get(), deadline, &from);
    if (fd.get() < 0)
      throw_error(ErrorKind::kTimeout, "rank ", opt_.rank, ": ", expect_accepts,
                  " connections from other ranks did not arrive within ", opt_.connect_timeout_s,
                  " s");
    std::string why;
    Channel ch = Channel::kData;
    int r = handshake_accept(fd.get(), hp, deadline_in(5), &ch, &why);
    const bool beat = ch == Channel::kHeartbeat;
    const bool fresh = r > opt_.rank && (beat ? !beating[r] : !links_[r] && data[r]);
    if (r < 0 || !fresh) {
      log(LogLevel::kWarning, opt_.rank, "refused connection from ", from, ": ",
          why.empty() ? cat("unexpected rank ", r) : why);
      continue;
    }
    if (beat) {
      beating[r] = true;
      tune_data_socket(fd.get(), opt_.link_timeout_s);
      heartbeat_->add(r, std::move(fd));
    } else {
      add_link(r, std::make_unique<TcpLink>(r, peers_[r].host_id, std::move(fd), chunk(),
                                            opt_.link_timeout_s));
    }
    --expect_accepts;
  }
}

Link& Context::link(int peer) {
  if (parent_ && peer >= 0 && peer < opt_.size && peer != opt_.rank)
    return parent_->link(members_[peer]);
  if (peer < 0 || peer >= opt_.size || parent_ || !links_[peer])
    throw_error(ErrorKind::kInternal, "rank ", opt_.rank, " has no link to rank ", peer);
  return *links_[peer];
}

uint8_t* Context::scratch(size_t slot, size_t bytes) {
  if (scratch_.size() <= slot) scratch_.resize(slot + 1);
  if (scratch_[slot].size() < bytes) scratch_[slot].resize(bytes);
  return scratch_[slot].data();
}

void Context::leave(const std::string& reason) {
  if (!segments_.empty() && segments_[local_rank_]) segments_[local_rank_]->mark_closed(reason);
  for (auto& l : links_)
    if (l) l->abort(reason);
}

void Context::mark_broken(const std::string& why) {
  if (parent_) return parent_->mark_broken(why);
  if (!broken_.empty()) return;
  broken_ = why;
  // Tell every peer, not only the ring neighbours that saw the failure. The
  // sockets stay open until close(): closing with unread data would reset the
  // connection and could destroy the last words before the peer reads them.
  leave(why);
}

void Context::check_usable() const {
  if (parent_) return parent_->check_usable();
  if (!broken_.empty())
    throw_error(ErrorKind::kPeerLost, "rank ", opt_.rank,
                ": ringreduce cannot continue after an earlier failure: ", broken_);
  if (!connected_ && opt_.size > 1)
    throw_error(ErrorKind::kInvalidArgument, "rank ", opt_.rank, ": not connected; call init()");
}

}  // namespace rr
