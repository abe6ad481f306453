#include "coordination/engine.h"

#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <thread>

#include "collectives/collective_util.h"
#include "collectives/op_header.h"
#include "common/env.h"
#include "common/logging.h"
#include "common/sha256.h"
#include "transport/heartbeat.h"
#include "transport/shm/doorbell.h"

namespace rr {

EngineOptions engine_options_from_env() {
  EngineOptions o;
  const int64_t fusion =
      env_int("RINGREDUCE_FUSION_THRESHOLD", static_cast<int64_t>(o.fusion_threshold));
  const int64_t cache =
      env_int("RINGREDUCE_CACHE_CAPACITY", static_cast<int64_t>(o.cache_capacity));
  o.cycle_time_s = env_double("RINGREDUCE_CYCLE_TIME_MS", 0) * 1e-3;
  o.batch_gap_s = env_double("RINGREDUCE_BATCH_US", o.batch_gap_s * 1e6) * 1e-6;
  o.batch_max_s = env_double("RINGREDUCE_BATCH_MAX_US", o.batch_max_s * 1e6) * 1e-6;
  o.stall_check_s = env_double("RINGREDUCE_STALL_CHECK_SECONDS", o.stall_check_s);
  o.stall_shutdown_s = env_double("RINGREDUCE_STALL_SHUTDOWN_SECONDS", o.stall_shutdown_s);
  o.timeline_path = env_str("RINGREDUCE_TIMELINE", "");
  o.timeline_mark_cycles = env_int("RINGREDUCE_TIMELINE_MARK_CYCLES", 0) != 0;
  o.thread_affinity = env_str("RINGREDUCE_THREAD_AFFINITY", "");
  o.fast_path = env_int("RINGREDUCE_FAST_PATH", 1) != 0;
  const int64_t fold = env_int("RINGREDUCE_FOLD_BYTES", -1);
  o.paired_rounds = env_int("RINGREDUCE_PAIRED_ROUNDS", 1) != 0;
  o.gpu_queue_depth = static_cast<int>(env_int("RINGREDUCE_GPU_QUEUE_DEPTH", o.gpu_queue_depth));
  if (fusion < 0 || cache < 0 || fold < -1 || o.cycle_time_s < 0 || o.stall_check_s < 0 ||
      o.stall_shutdown_s < 0 || o.batch_gap_s < 0 || o.batch_max_s < 0 || o.gpu_queue_depth < 0)
    throw_error(ErrorKind::kInvalidArgument, "RINGREDUCE_FUSION_THRESHOLD, ",
                "RINGREDUCE_CACHE_CAPACITY, RINGREDUCE_FOLD_BYTES, RINGREDUCE_CYCLE_TIME_MS, "
                "RINGREDUCE_BATCH_*_US, RINGREDUCE_GPU_QUEUE_DEPTH ",
                "and RINGREDUCE_STALL_*_SECONDS must not be negative");
  o.fusion_threshold = static_cast<uint64_t>(fusion);
  o.cache_capacity = static_cast<size_t>(cache);
  o.fold_bytes = fold < 0 ? kFoldAuto : static_cast<size_t>(fold);
  o.autotune = autotune_options_from_env();
  // A longer gap would be cut at the batch's maximum anyway.
  o.autotune.batch_hi_us = std::min(o.autotune.batch_hi_us, o.batch_max_s * 1e6);
  if (!(o.autotune.batch_hi_us > 0)) o.autotune.fixed_batch = true;  // batching is off
  o.autotune.cache_enabled = o.cache_capacity > 0;
  return o;
}

Engine::Engine(std::shared_ptr<Context> ctx, EngineOptions opt)
    : ctx_(std::move(ctx)),
      opt_(std::move(opt)),
      rank_(ctx_->rank()),
      size_(ctx_->size()),
      cache_(opt_.cache_capacity),
      ctrl_(*ctx_),
      batch_(opt_.batch_gap_s, opt_.batch_max_s),
      token_(batch_.signal()->token()),
      t0_(std::chrono::steady_clock::now()) {
  ctx_->check_usable();
  if (rank_ == 0) {
    timeline_ = std::make_unique<Timeline>();
    if (!opt_.timeline_path.empty())
      timeline_->start(opt_.timeline_path, opt_.timeline_mark_cycles);
  }
  for (int w = 1; rank_ == 0 && w < size_; ++w) workers_.push_back(w);
  early_.resize(size_);
  early_solo_.resize(size_);
  if (opt_.fold_bytes == kFoldAuto) opt_.fold_bytes = auto_fold_bytes();
  // A folded call is reduced with the direct path's arithmetic: folding a size the
  // ring would reduce would make a result depend on whether it was folded (N >= 3).
  opt_.fold_bytes = std::min<size_t>(opt_.fold_bytes, ctx_->options().small_bytes);
  if (rank_ == 0)
    negotiator_ = std::make_unique<Negotiator>(
        NegotiatorOptions{size_, opt_.fusion_threshold, opt_.stall_check_s, opt_.stall_shutdown_s},
        timeline_.get());
  executors_.push_back(make_cpu_executor(*ctx_, timeline_.get()));
  cycle_s_.store(opt_.cycle_time_s);
  engine_core_ = affinity_core();
  make_tuner();
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  RR_CHECK(wake_fd_ >= 0, "rank ", rank_, ": eventfd: ", errno_string(errno));
  waker_ = std::make_shared<CompletionWaker>([this] {
    device_done_.store(true);
    wake_engine();
    if (opt_.gpu_queue_depth > 0) batch_.signal()->poke();  // hold_for_device() sleeps there
  });
  ctx_->set_phase_observer(timeline_.get());
  bell_only_ = bell_only();
  if (opt_.fast_path) token_.set_driver(this);
  thread_ = std::thread([this] { loop(); });
}

// Settings every rank must share (cache ids must evict alike; the direct /
// ring choice decides what goes on the wire) ride in the name of one barrier,
// the thread's first act: a difference fails every rank's engine with a
// MismatchError that shows each rank's values.
void Engine::agree_on_settings() {
  // Short lines: a header name holds kMaxHeaderName - 1 characters; values too
  // long for that are compared by digest (still a mismatch, less readable).
  auto agree = [this](std::string name) {
    if (name.size() >= static_cast<size_t>(kMaxHeaderName)) {
      const auto d = sha256(name.data(), name.size());
      name = "settings RINGREDUCE_* digest ";
      const char* hex = "0123456789abcdef";
      for (int i = 0; i < 16; ++i) {
        name += hex[d[i] >> 4];
        name += hex[d[i] & 15];
      }
    }
    barrier(*ctx_, name);
  };
  agree(cat("RINGREDUCE_* CACHE_CAPACITY=", opt_.cache_capacity, " SMALL_BYTES=",
            ctx_->options().small_bytes, " RING_SLICE_BYTES=", ctx_->options().ring_slice_bytes));
  // The autotuner: every rank must end its samples at the same response and
  // tune the same knobs, and run the same allgather algorithm (each rank
  // chooses it alone).
  agree(cat("RINGREDUCE_* AUTOTUNE=", opt_.autotune.enabled ? opt_.autotune.steps_per_sample : 0,
            opt_.autotune.enabled ? ":" + opt_.autotune.fixed_mask() : "",
            " HIERARCHICAL_ALLGATHER=", ctx_->options().hierarchical_allgather));
}

// Horovod's HOROVOD_THREAD_AFFINITY: "c0,c1,...", entry i the core of local
// rank i's background thread. A value that is not a list of core numbers is
// refused on every rank alike (they read the same value). A list too short
// for this host, or a core this thread may not use, leaves the thread
// unpinned with a warning, as Horovod does: horovodrun's --thread-affinity
// takes one number, and a ported job must still run.
int Engine::affinity_core() const {
  const std::string& v = opt_.thread_affinity;
  if (v.empty()) return -1;
  std::vector<int> cores;
  std::string item;
  // getline drops a last empty item: read "0," as "0," + "" as the user wrote it
  std::stringstream in(v.back() == ',' ? v + "," : v);
  while (std::getline(in, item, ',')) {
    const bool digits = !item.empty() && item.size() < 8 &&
                        item.find_first_not_of("0123456789") == std::string::npos;
    const long c = digits ? std::strtol(item.c_str(), nullptr, 10) : -1;
    if (c < 0 || c >= CPU_SETSIZE)
      throw_error(ErrorKind::kInvalidArgument, "rank ", rank_, ": RINGREDUCE_THREAD_AFFINITY='", v,
                  "': '", item, "' is not a core number (0 to ", CPU_SETSIZE - 1,
                  "), one per local rank, comma-separated");
    cores.push_back(static_cast<int>(c));
  }
  const int local = ctx_->local_rank();
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return -1;
  if (local >= static_cast<int>(cores.size())) {
    log(LogLevel::kWarning, rank_, "RINGREDUCE_THREAD_AFFINITY='", v, "' names ", cores.size(),
        " core(s), one per local rank, but this rank is local rank ", local, " of ",
        ctx_->local_size(), ": its engine thread is not pinned");
    return -1;
  }
  if (!CPU_ISSET(cores[local], &allowed)) {
    std::string may;
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &allowed)) may += cat(may.empty() ? "" : ",", c);
    log(LogLevel::kWarning, rank_, "RINGREDUCE_THREAD_AFFINITY='", v, "' gives local rank ", local,
        " core ", cores[local], ", which this process may not use (cores ", may,
        "): its engine thread is not pinned");
    return -1;
  }
  return cores[local];
}

// Folding copies a contribution several times (engine_fold.cc) to save one
// crossing of a link: worth it up to 1 KiB where every link between this rank
// and the coordinator shares memory, up to 16 KiB across a socket (README
// "Folded rounds" has the measurements). Ranks need not agree: a worker folds
// what its own limit allows, rank 0 folds what every worker sent.
size_t Engine::auto_fold_bytes() const {
  bool socket = false;
  for (int p = 0; p < size_; ++p)
    if (p != rank_ && (rank_ == 0 || p == 0)) socket |= !ctx_->link(p).transport().shares_memory;
  return socket ? 16384 : 1024;
}

Engine::~Engine() {
  shutdown();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

double Engine::now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

// ------------------------------------------------------------- submitting
// A process set lists distinct ranks of the job in ascending order, this
// rank among them (Python's ProcessSet guarantees it; checked again here).
void Engine::validate_members(const RequestMeta& m) const {
  const auto& ms = m.members;
  bool ok = ms.empty() || (ms.front() >= 0 && ms.back() < size_);
  for (size_t i = 1; ok && i < ms.size(); ++i) ok = ms[i - 1] < ms[i];
  if (!ok)
    throw_error(ErrorKind::kInvalidArgument, "rank ", rank_, ": ", coll_name(m.kind), " '", m.name,
                "': process set ", ranks_text(ms), " must list distinct ranks of [0, ", size_,
                ") in ascending order");
  if (!m.has_rank(rank_))
    throw_error(ErrorKind::kInvalidArgument, "rank ", rank_, ": ", coll_name(m.kind), " '", m.name,
                "': this rank is not a member of process set ", ranks_text(ms));
}

void Engine::validate(Entry& e) {
  const RequestMeta& m = e.meta;
  const char* what = coll_name(m.kind);
  Tensor t{e.in, m.shape, m.dtype, m.name};
  check_shape(*ctx_, t, what);
  validate_members(m);
  const int n = m.set_size(size_);
  switch (m.kind) {
    case CollKind::kAllreduce:
    case CollKind::kReducescatter:
      if (m.op == ReduceOp::kAdasum && m.kind == CollKind::kAllreduce)
        check_adasum(rank_, t, n, m.device, what);
      else
        check_reduce(*ctx_, t, m.op, what);
      check_scales(*ctx_, t, m.prescale, m.postscale, what);
      if (m.kind == CollKind::kReducescatter) check_has_rows(*ctx_, t, what);
      break;
    case CollKind::kAllgather: check_has_rows(*ctx_, t, what); break;
    case CollKind::kAlltoall:
      check_has_rows(*ctx_, t, what);
      if (m.members.empty())
        check_splits(*ctx_, t, e.splits);
      else if (static_cast<int>(e.splits.size()) != n)
        throw_error(ErrorKind::kInvalidArgument, "rank ", rank_, ": alltoall '", m.name,
                    "': splits must have one entry per rank of process set ", ranks_text(m.members),
                    "; got ", e.splits.size());
      break;
    case CollKind::kBroadcast:
      if (m.root < 0 || m.root >= n)
        throw_error(ErrorKind::kInvalidArgument, "rank ", rank_, ": broadcast '", m.name,
                    "': root_rank ", m.root, " is not in [0, ", n, ")",
                    m.members.empty() ? "" : " (ranks of the process set)");
      break;
    case CollKind::kBarrier: break;
  }
}

void Engine::enqueue_locked(std::vector<Entry>& entries, const std::shared_ptr<HandleState>& h) {
  if (failed_)
    throw Error(fail_kind_, cat("rank ", rank_, ": cannot start ", coll_name(entries[0].meta.kind),
                                " '", entries[0].meta.name, "': ringreduce stopped after an ",
                                "earlier failure: ", fail_message_));
  if (stopping_)
    throw_error(ErrorKind::kInvalidArgument, "rank ", rank_, ": cannot start ",
                coll_name(entries[0].meta.kind), " '", entries[0].meta.name,
                "': ringreduce has been shut down; call init() again");
  std::unordered_set<std::string> batch;  // names within this call (a group)
  const bool group = entries.size() > 1;
  for (const Entry& e : entries) {
    const std::string& n = e.meta.name;
    if (e.join) continue;  // named "join", but not a tensor: a user's "join" may be in flight
    if (!n.empty() && (in_flight_.count(n) || (group && !batch.insert(n).second)))
      throw_error(ErrorKind::kInvalidArgument, "rank ", rank_, ": ", coll_name(e.meta.kind), " '",
                  n, "': a tensor of this name is already in flight on this rank; synchronize() ",
                  "it before submitting the name again, or give each tensor its own name");
  }
  // Unnamed calls are named by one counter for every kind, so ranks that make
  // different unnamed calls at the same point get a mismatch error naming
  // both calls. Every completed join() restarts the count in a new epoch:
  // ranks that ran more batches before joining made more unnamed calls, and
  // the names must agree again once all have joined. Each process set counts
  // its own: its members make its unnamed calls in one order, whatever else
  // each of them calls meanwhile. A call refused here still takes its name
  // and is told to rank 0 (reject_locked), so that names stay in step and the
  // other ranks' calls of that name fail instead of waiting for this one.
  std::vector<Entry*> unnamed;  // validated by submit() when named
  for (Entry& e : entries) {
    if (!e.meta.name.empty() || e.join) continue;
    e.meta.name = unnamed_locked(e.meta.members);
    unnamed.push_back(&e);
  }
  try {
    for (Entry* e : unnamed) validate(*e);
  } catch (const Error& err) {
    reject_locked(entries, err.what());
    throw;
  }
  batch_.submitted(queue_.empty());
  bool host = false;
  for (size_t i = 0; i < entries.size(); ++i) {
    host |= entries[i].meta.device < 0 || entries[i].join;
    entries[i].handle = h;
    entries[i].index = i;
    if (!entries[i].join) in_flight_.insert(entries[i].meta.name);
    queue_.push_back(std::move(entries[i]));
  }
  has_work_.store(true);
  if (host) end_device_hold();
}

// Host work and refusals are never held behind a busy device: a thread asleep
// in hold_for_device() hears of them now, not at the end of its sleep. Only
// with the hold on: otherwise each submit would cost a batch hold a wake-up.
void Engine::end_device_hold() {
  host_queued_.store(true);
  if (opt_.gpu_queue_depth > 0) batch_.signal()->poke();
}

// The next name of an unnamed call on the process set `members` (empty:
// the global set); see enqueue_locked().
std::string Engine::unnamed_locked(const std::vector<int32_t>& members) {
  // A set's join(process_set=) starts a new epoch of the set's names alone.
  const std::string prefix = join_epoch_ ? cat("noname.", join_epoch_, ".") : "noname.";
  if (members.empty()) return cat(prefix, noname_++);
  auto epoch = set_join_epochs_.find(members);
  return cat(prefix, "set", ranks_text(members), ".",
             epoch == set_join_epochs_.end() ? "" : cat(epoch->second, "."),
             noname_sets_[members]++);
}

static std::string set_name(const std::string& name, const std::vector<int32_t>& members) {
  return members.empty() ? name : cat(name, "@", ranks_text(members));
}

std::shared_ptr<HandleState> Engine::submit(std::vector<Entry> entries) {
  RR_CHECK(!entries.empty(), "rank ", rank_, ": submit of no tensors");
  auto h = std::make_shared<HandleState>(entries.size(), batch_.signal());
  for (const Entry& e : entries)
    if (e.meta.device >= 0) gpu_seen_.store(true);
  // Named entries are checked before taking the lock, which submitting
  // threads and the engine contend for; unnamed ones need their name first.
  // A process set's names are its own (as in Horovod, where each set has its
  // own tensor table): two sets may use one name at the same time.
  for (Entry& e : entries)
    if (!e.meta.name.empty()) e.meta.name = set_name(e.meta.name, e.meta.members);
  // A group's tag carries its member count: ranks that group different numbers of
  // tensors under one name disagree on it, and the negotiator fails the whole group.
  for (Entry& e : entries)
    if (!e.meta.group.empty()) e.meta.group = cat(e.meta.group, "#", entries.size());
  try {
    for (Entry& e : entries)
      if (!e.meta.name.empty() || e.join) validate(e);
  } catch (const Error& err) {
    std::lock_guard<std::mutex> lock(mu_);
    reject_locked(entries, err.what());
    throw;
  }
  // notify() under the lock: shutdown() sets stopping_ under it before the
  // Context (and its doorbell) can go away.
  std::lock_guard<std::mutex> lock(mu_);
  enqueue_locked(entries, h);
  notify();
  return h;
}

// Every named entry of the refused call is reported: the other ranks wait
// for each of them (a group's members, or the only one). A join is nothing
// the others wait for by name. A call naming a tensor this rank has in flight
// is a duplicate, whatever else is wrong with it: refused here alone, taking
// no place (as enqueue_locked refuses duplicates), so the call in flight goes
// on. Reported, it could not say which call it refuses: the one in flight may
// finish at rank 0 (a paired round, engine_pair.cc) before the refusal arrives.
void Engine::reject_locked(const std::vector<Entry>& entries, const std::string& why) {
  if (failed_ || stopping_ || size_ == 1) return;
  for (const Entry& e : entries)
    if (!e.join && in_flight_.count(e.meta.name)) return;
  for (const Entry& e : entries)
    if (!e.join && !e.meta.name.empty())
      rejected_.push_back(Rejection{e.meta.kind, e.meta.name, why, e.meta.members});
  has_work_.store(true);
  end_device_hold();  // a refusal goes out at once
  notify();
}

void Engine::reject(CollKind kind, const std::string& name, const std::string& why,
                    const std::vector<int32_t>& members) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry e;
  e.meta.kind = kind;
  e.meta.members = members;
  e.meta.name = name.empty() ? unnamed_locked(members) : set_name(name, members);
  reject_locked({e}, why);
}

std::shared_ptr<SharedRegion> Engine::create_shared(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_)
      throw Error(fail_kind_, cat("rank ", rank_, ": cannot allocate a shared buffer: ringreduce ",
                                  "stopped after an earlier failure: ", fail_message_));
    if (stopping_)
      throw_error(ErrorKind::kInvalidArgument, "rank ", rank_, ": cannot allocate a shared ",
                  "buffer: ringreduce has been shut down; call init() again");
  }
  return ctx_->create_shared(bytes);
}

uint64_t Engine::join_epoch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return join_epoch_;
}

std::shared_ptr<HandleState> Engine::join(const std::vector<int32_t>& members, int32_t gpu_device) {
  Entry e;
  e.join = true;
  e.join_device = gpu_device;
  e.meta.kind = CollKind::kBarrier;
  e.meta.name = "join";
  e.meta.members = members;
  std::vector<Entry> one;
  one.push_back(std::move(e));
  return submit(std::move(one));
}

// Callers set has_work_ before this; the thread sets polling_ before its
// last check of has_work_ (both sequentially consistent), so either the
// thread sees the work or this sees polling_ and writes the eventfd. Most
// submits therefore cost no system call.
void Engine::notify() {
  if (Doorbell* bell = ctx_->progress().doorbell) bell->ring();
  if (!polling_.load()) return;
  const uint64_t one = 1;
  ssize_t ignored = ::write(wake_fd_, &one, sizeof one);
  (void)ignored;
}

void Engine::shutdown() {
  // Every caller returns only once the thread has stopped (the caller closes
  // the Context next); only the first does the work.
  std::lock_guard<std::mutex> once(shutdown_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    notify();
  }
  stop_.store(true);
  wake_engine();             // a parked thread does not hear notify()
  batch_.signal()->close();  // a thread holding a batch back sleeps on it
  interrupt_after_grace();
  if (thread_.joinable()) thread_.join();
  waker_->disarm();  // a device may finish work later: it must not touch this engine
  token_.retire();   // after a driving caller gives it back; fail_all needs it
  watcher_.reset();  // before the Context (and its doorbell) can go away
  fail_all(ErrorKind::kInternal,
           cat("rank ", rank_, ": ringreduce was shut down before this collective completed"));
  ctx_->set_phase_observer(nullptr);
  if (timeline_) timeline_->stop();
}

// A round in flight normally ends within milliseconds, and shutdown() lets it. One
// that waits for a frozen peer (SIGSTOP, a swapping host) would only end at the
// peer's heartbeat timeout (RINGREDUCE_PEER_TIMEOUT_SECONDS, minutes): after the
// grace the Context interrupts its waits that have moved nothing for a second (a
// large transfer still moving finishes), so leaving the job stays prompt.
void Engine::interrupt_after_grace() {
  constexpr auto kGrace = std::chrono::seconds(2);
  const auto until = std::chrono::steady_clock::now() + kGrace;
  while (thread_.joinable() && !loop_exited_.load() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (thread_.joinable() && !loop_exited_.load()) {
    log(LogLevel::kInfo, rank_, "shutdown: a round is still in flight after ", kGrace.count(),
        " s; a wait that stops moving is given up");
    ctx_->interrupt();
  }
}

void Engine::start_timeline(const std::string& path, bool mark_cycles) {
  if (timeline_) timeline_->start(path, mark_cycles);
}

void Engine::stop_timeline() {
  if (timeline_) timeline_->stop();
}

void Engine::set_device_executor_factory(ExecutorFactory f) {
  std::lock_guard<std::mutex> lock(mu_);
  device_factory_ = std::move(f);
}

EngineStats Engine::stats() const {
  EngineStats s;
  s.rounds = rounds_done_.load();
  s.responses = executed_responses_.load();
  s.tensors = executed_tensors_.load();
  s.shared_allreduces = ctx_->shared_allreduces();
  s.hierarchical_allreduces = ctx_->hierarchical_allreduces();
  s.hierarchical_allgathers = ctx_->hierarchical_allgathers();
  s.adasum_allreduces = ctx_->adasum_allreduces();
  s.caller_rounds = caller_rounds_.load();
  s.folded = folded_.load();
  s.paired = paired_.load();
  s.gpu_device = gpu_device_.load();
  s.device_holds = device_holds_.load();
  tuned_stats(s);
  return s;
}

// ------------------------------------------------------------ the thread
namespace {
// While an asynchronous executor has work in flight the idle thread polls it
// for this long without sleeping (short device work completes without a
// wake-up), then sleeps until the executor's waker rings (the work finished)
// or device_poll_s_ passes (NCCL's asynchronous errors are found by polling).
// A batch held back meanwhile is held at most kBusyHoldNs at a time.
constexpr double kBusySpinSeconds = 50e-6;
constexpr int64_t kBusyHoldNs = 1'000'000;
}  // namespace

void Engine::loop() {
  // Named, so that per-thread CPU use (/proc/<pid>/task/*/comm, top -H) tells
  // the engine from the compute threads it competes with.
  pthread_setname_np(pthread_self(), "rr-engine");
  if (engine_core_ >= 0) {  // checked by affinity_core(): the process may run there
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(engine_core_, &one);
    const int err = pthread_setaffinity_np(pthread_self(), sizeof one, &one);
    if (err != 0)
      log(LogLevel::kWarning, rank_, "RINGREDUCE_THREAD_AFFINITY: pinning the engine thread to ",
          "core ", engine_core_, " failed: ", errno_string(err));
  }
  try {
    agree_on_settings();
    while (idle_wait() == Wake::kWork) run_round();
  } catch (const Error& e) {
    fail_engine(e);
  } catch (const std::exception& e) {
    fail_engine(Error(ErrorKind::kInternal, cat("rank ", rank_, ": engine thread: ", e.what())));
  }
  token_.give_back();  // held at every exit: shutdown() retires it
  loop_exited_.store(true);
}

// The driver (engine thread or caller) runs one round and what it decided.
void Engine::run_round() {
  last_round_ = now();
  if (rank_ == 0)
    coordinator_round();
  else
    worker_round();
  rounds_done_.fetch_add(1, std::memory_order_relaxed);
  if (async_) poll_executors();
  if (timeline_) timeline_->flush();
}

// Arrived messages may hold a round back for a moment (engine_pair.cc).
bool Engine::ready_to_start() {
  if (has_work_.load() && (cycle_s_.load() <= 0 || now() - last_round_ >= cycle_s_.load()))
    return true;
  if (arrived()) return true;
  return rank_ == 0 && now() >= negotiator_->next_deadline();
}

// Runs `f` (a yield, a batch hold, a sleep) without the driver token, so that
// a caller may drive meanwhile; returns holding it again (engine_drive.cc).
template <class F>
void Engine::untokened(F&& f) {
  token_.give_back();
  f();
  reclaim_token();
}

Engine::Wake Engine::idle_wait() {
  const ProgressSettings& ps = ctx_->progress();
  const double start = now();
  double last_check = start;
  for (;;) {  // holding the token at the top of every pass
    if (stop_.load() || dead_.load()) return Wake::kStop;
    const bool busy = async_busy();
    if (busy)
      poll_executors();
    else  // a ring that came after the poll which completed the work: nothing left to wait for
      device_done_.store(false);
    bool held = false;
    if (has_work_.load())  // without the token: the caller may come to drive
      untokened([&] { held = batch_.hold(busy ? kBusyHoldNs : BatchWindow::kMaxSleepNs); });
    const bool was_holding = device_holding_;
    device_holding_ = !held && busy && hold_for_device();
    if (device_holding_ && !was_holding) device_holds_.fetch_add(1, std::memory_order_relaxed);
    held = held || device_holding_;
    if (held) {
      check_peers(last_check);
      continue;
    }
    try {
      if (ready_to_start()) return Wake::kWork;
    } catch (const Error& e) {
      throw Error(e.kind(), cat("rank ", rank_, ": ", idle_state(), ": ", e.what()));
    }
    const double t = now();
    if (t - start < ps.spin_seconds || (busy && t - start < kBusySpinSeconds)) {
      // Always yield: the caller this round woke must get a core at once,
      // and with every rank's engine spinning on a small machine it would
      // otherwise wait for the scheduler to preempt one.
      untokened([] { sched_yield(); });
      continue;
    }
    check_peers(last_check);
    double timeout = busy ? device_poll_s_.load() : 0.1;
    if (has_work_.load()) timeout = std::min(timeout, last_round_ + cycle_s_.load() - t);
    if (rank_ == 0) timeout = std::min(timeout, negotiator_->next_deadline() - t);
    timeout = std::min(timeout, hold_deadline() - t);
    block(static_cast<int64_t>(std::max(timeout, 0.0) * 1e9));
  }
}

// Device backlog (opt-in: RINGREDUCE_GPU_QUEUE_DEPTH, e.g. 2; 0 by default).
// A rank's new GPU work is held back while one of its GPUs still has
// `gpu_queue_depth` responses enqueued (e.g. a running one and the next):
// a round now would only queue one more NCCL call behind them, while what the
// caller submits until the device catches up goes out fused in one response.
// Where each call is slow (NCCL over sockets, across hosts) a backward pass
// then costs a few large calls instead of one per burst of gradients; where
// calls are quick the backlog never forms and nothing is held. The hold ends
// when the device finishes a response (the waker pokes the WaitSignal), when
// a caller begins to wait (a blocking call, synchronize()), when another
// rank's round arrives, or after kBusyHoldNs (the thread then looks again).
// Work for the host, and refusals, are never held: ranks agree on responses
// as before, so nothing else changes, and no in-flight work depends on a
// rank's later requests (responses already agreed run on every rank).
// Why not by default: a response in flight also counts while it waits for its
// gradients to be produced, so during a backward pass the host, which runs
// ahead of the GPU, would hold most gradients until synchronize() and send
// them in one call that no longer overlaps the backward pass (DDP caps its
// last bucket at 25 MB for this reason). Not yet measured on a GPU.
bool Engine::hold_for_device() {
  if (opt_.gpu_queue_depth <= 0 || !has_work_.load() || host_queued_.load()) return false;
  size_t queued = 0;
  for (const auto& ex : executors_) queued = std::max(queued, ex->in_flight());
  if (queued < static_cast<size_t>(opt_.gpu_queue_depth)) return false;
  WaitSignal& s = *batch_.signal();
  try {
    if (s.waiting() || s.closed() || arrived()) return false;
  } catch (const Error&) {
    return false;  // ready_to_start() meets it again and reports it with context
  }
  // Rank 0's stall checks and stall shutdown run in ready_to_start(): a device
  // stuck behind a peer would otherwise hold them (and their report) forever.
  int64_t sleep_ns = kBusyHoldNs;
  if (rank_ == 0) {
    const double left = negotiator_->next_deadline() - now();
    if (left <= 0) return false;
    if (left < kBusyHoldNs * 1e-9) sleep_ns = static_cast<int64_t>(left * 1e9) + 1;  // not inf
  }
  untokened([&] { s.sleep(sleep_ns, &device_done_); });
  return true;
}

// Every 100 ms of idling (asleep, or holding a batch back) the thread checks
// that its peers are alive: a dead one otherwise goes unnoticed until the
// next round needs it.
void Engine::check_peers(double& last_check) {
  const double t = now();
  if (t - last_check < 0.1) return;
  try {
    for (int p = 0; p < size_; ++p)
      if (p != rank_) ctx_->link(p).check_alive();
    if (const Heartbeat* hb = ctx_->progress().heartbeat) hb->check();
  } catch (const Error& e) {
    throw Error(e.kind(), cat("rank ", rank_, ": ", idle_state(), ": ", e.what()));
  }
  last_check = t;
}

// What the thread was doing between rounds, for errors found meanwhile: a
// caller in a loop of collectives is not "idle" while its call waits.
std::string Engine::idle_state() const {
  if (!pending_.empty())
    return cat("while waiting for the other ranks to submit ",
               coll_name(pending_.begin()->second.meta.kind), " '", pending_.begin()->first, "'",
               pending_.size() > 1 ? cat(" (and ", pending_.size() - 1, " more)") : "");
  if (has_work_.load()) return "while holding submitted work back (RINGREDUCE_BATCH_US)";
  return "while idle";
}

// A sleep of `timeout_ns` cut to the deadline of a hold that the last
// ready_to_start() may have begun (engine_pair.cc).
int64_t Engine::within_hold(int64_t timeout_ns) const {
  if (!holding_) return timeout_ns;
  const double left = std::max(hold_deadline() - now(), 0.0);
  return std::min(timeout_ns, static_cast<int64_t>(left * 1e9));
}

// Sleeps until a peer may have sent something, a caller submitted work, or
// the timeout passes, as the watched links' transports say (transports.h).
// Doorbell links only: the doorbell (peers and notify() ring it). Otherwise
// poll() on the fd links and the wake eventfd, with a watcher turning a
// doorbell ring into an eventfd write when both kinds are watched.
void Engine::block(int64_t timeout_ns) {
  std::vector<pollfd> fds{pollfd{wake_fd_, POLLIN, 0}};
  bool any_bell = false;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || (rank_ != 0 && p != 0)) continue;
    const Link& link = ctx_->link(p);
    if (link.transport().wait & kWaitFd) fds.push_back(pollfd{link.poll_fd(), POLLIN, 0});
    any_bell |= (link.transport().wait & kWaitDoorbell) != 0;
  }
  Doorbell* bell = ctx_->progress().doorbell;
  if (fds.size() == 1 && bell) {
    const uint32_t seen = bell->snapshot();
    bell->set_sleeping(true);
    engine_bell_ = true;  // withdrawn by reclaim_token(), or by a driving caller
    if (!stop_.load() && !device_done_.load() && !ready_to_start())
      untokened([&] { bell->wait(seen, within_hold(timeout_ns)); });
    withdraw_bell();
    return;
  }
  // Sockets, and doorbell peers too: the watcher turns a doorbell ring into
  // an eventfd write (protocol in doorbell_watcher.h).
  const bool watch = any_bell && bell;
  if (watch) {
    if (!watcher_) watcher_ = std::make_unique<DoorbellWatcher>(bell, wake_fd_);
    const uint32_t seen = bell->snapshot();
    bell->set_sleeping(true);
    watcher_->arm(seen);
  }
  polling_.store(true);
  if (!stop_.load() && !device_done_.load() && !ready_to_start()) {
    const int ms = static_cast<int>((within_hold(timeout_ns) + 999999) / 1000000);
    int ready = 0;
    untokened([&] { ready = ::poll(fds.data(), fds.size(), ms); });
    if (ready > 0 && (fds[0].revents & POLLIN)) {
      uint64_t v;
      ssize_t ignored = ::read(wake_fd_, &v, sizeof v);
      (void)ignored;
    }
  }
  polling_.store(false);
  if (watch) {
    watcher_->disarm();
    bell->set_sleeping(false);
  }
}

// -------------------------------------------------------------- failures
void Engine::fail_all(ErrorKind kind, const std::string& why) {
  std::deque<Entry> queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queued.swap(queue_);
    in_flight_.clear();
    has_work_.store(false);
  }
  auto fail = [&](Entry& e) {
    e.handle->fail_one(kind, e.join ? cat("rank ", rank_, ": join could not complete: ", why)
                                    : cat("rank ", rank_, ": ", coll_name(e.meta.kind), " '",
                                          e.meta.name, "' could not complete: ", why));
  };
  for (auto& e : queued) fail(e);
  for (auto& [name, e] : pending_) fail(e);
  for (auto& e : joins_) fail(e);
  pending_.clear();
  joins_.clear();
}

void Engine::fail_engine(const Error& e) {
  ctx_->mark_broken(e.what());
  dead_.store(true);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_) {
      failed_ = true;
      fail_kind_ = e.kind();
      fail_message_ = e.what();
    }
  }
  // The driver (engine thread or driving caller) owns the executors.
  for (auto& ex : executors_) ex->abort(e.what());
  fail_all(fail_kind_, e.what());
}

}  // namespace rr
