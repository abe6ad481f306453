// One negotiation round of the Engine (protocol in control.h) and the
// execution of its responses. Runs on the engine thread only.
#include <algorithm>

#include "common/logging.h"
#include "coordination/engine.h"

namespace rr {

RequestMeta Engine::rejected_meta(const Rejection& rj) {
  RequestMeta m;
  m.kind = rj.kind;
  m.name = rj.name;
  m.members = rj.members;
  return m;
}

namespace {

void expect(const CtrlMessage& m, CtrlType type, uint64_t round, int rank) {
  if (m.type != type || m.round != round)
    throw_error(ErrorKind::kInternal, "rank ", rank, ": control message ", int(m.type),
                " of round ", m.round, " from rank ", m.from, " where ", int(type), " of round ",
                round, " was due (streams out of step)");
}

}  // namespace

// The lock is held only for a swap: submitting threads contend for it, and a
// contended mutex costs both sides a futex system call.
// A driving caller leaves everything queued once a GPU tensor was submitted
// (submit() says so before queueing it): GPU work runs on the engine thread
// (engine_drive.cc), which takes the queue over.
std::vector<Entry> Engine::drain() {
  std::deque<Entry> taken;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (gpu_seen_.load() && token_.held_by_caller()) return {};
    taken.swap(queue_);
    rejections_.swap(rejected_);
    rejected_.clear();
    has_work_.store(false);
    host_queued_.store(false);
  }
  for (const Rejection& rj : rejections_) refused_names_.insert(rj.name);
  return std::vector<Entry>(std::make_move_iterator(taken.begin()),
                            std::make_move_iterator(taken.end()));
}

void Engine::release_names(const std::vector<std::string>& names) {
  if (names.empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::string& n : names) in_flight_.erase(n);
}

// Fresh entries wait for their response in the pending table (looked up by
// name when a response names them) or, for join(), in the join list.
void Engine::record_local(std::vector<Entry>& fresh) {
  for (Entry& e : fresh) {
    if (e.join) {
      if (e.join_device >= 0) join_device_ = e.join_device;
      if (e.meta.members.empty())
        joined_ = true;
      else
        joined_sets_.push_back(e.meta.members);
      joins_.push_back(std::move(e));
    } else {
      std::string name = e.meta.name;
      pending_.emplace(std::move(name), std::move(e));
    }
  }
}

void Engine::coordinator_round() {
  const uint64_t k = round_;
  if (timeline_) timeline_->cycle_start();
  auto what = [k] { return cat("negotiation round ", k); };
  std::vector<Entry> fresh = drain();
  const std::vector<uint8_t> promise = promise_for(fresh);  // engine_pair.cc
  for (int w = 1; w < size_; ++w) ctrl_.post(w, CtrlType::kPoll, k, promise);
  const double t = now();
  bool join = false;
  std::vector<RequestMeta> submitted;
  for (const Entry& e : fresh) {
    if (e.join && !e.meta.members.empty())
      negotiator_->join(0, t, e.meta.members);
    else if (e.join)
      join = true;
    else
      submitted.push_back(e.meta);
  }
  submit_in_order(0, std::move(submitted), rejections_, t);
  if (join) negotiator_->join(0, t);
  rejections_.clear();
  record_local(fresh);
  const bool paired = size_ > 1 && receive_requests(k, promise);
  std::vector<Response> rs = negotiator_->decide(now());
  fold_responses(rs);
  if (paired) {
    ctrl_.flush(what);  // the POLL with the promise
    finish_paired_coordinator(rs);
  } else {
    if (size_ > 1) {
      std::vector<uint8_t> payload = encode_responses(rs);
      for (int w = 1; w < size_; ++w) ctrl_.post(w, CtrlType::kResponses, k, payload);
      ctrl_.flush(what);
    }
    process(rs);
  }
  ++round_;
}

// Rank 0: every worker's REQUESTS(k), read ahead or now, decoded in rank
// order. Returns whether the round is paired (engine_pair.cc).
bool Engine::receive_requests(uint64_t k, const std::vector<uint8_t>& promise) {
  const double t = now();
  std::vector<std::unique_ptr<CtrlMessage>> by_worker(size_);
  std::vector<int> missing;
  for (int w = 1; w < size_; ++w) {
    by_worker[w] = take_early(w);
    if (!by_worker[w]) missing.push_back(w);
  }
  if (!missing.empty())
    for (CtrlMessage& m : ctrl_.receive(missing, [k] { return cat("negotiation round ", k); }))
      by_worker[m.from] = std::make_unique<CtrlMessage>(std::move(m));
  bool paired = false;
  for (int w = 1; w < size_; ++w) {
    const CtrlMessage& m = *by_worker[w];
    expect(m, CtrlType::kRequests, k, rank_);
    paired = solo_for(m.payload, m.from, promise);
    decode_requests(m.from, m.payload, t);
  }
  return paired;
}

// A rank's refusals and submissions of one round, in the order they happened
// (decode_requests_from).
void Engine::submit_in_order(int rank, std::vector<RequestMeta> submitted,
                             const std::vector<Rejection>& refused, double t) {
  for (const Rejection& rj : refused) negotiator_->reject(rank, rejected_meta(rj), rj.why, t);
  for (RequestMeta& m : submitted) negotiator_->submit(rank, std::move(m), t);
}

void Engine::worker_round() {
  const uint64_t k = round_;
  auto what = [k] { return cat("negotiation round ", k); };
  std::vector<Entry> fresh = drain();
  const bool join = std::any_of(fresh.begin(), fresh.end(),
                                [](const Entry& e) { return e.join && e.meta.members.empty(); });
  const std::vector<uint8_t> requests = encode_requests(fresh, join);
  ctrl_.post(0, CtrlType::kRequests, k, requests);
  record_local(fresh);
  std::unique_ptr<CtrlMessage> poll = take_early(0);
  if (!poll) poll = std::make_unique<CtrlMessage>(std::move(ctrl_.receive({0}, what).at(0)));
  expect(*poll, CtrlType::kPoll, k, rank_);
  if (!poll->payload.empty()) ctrl_.flush(what);  // REQUESTS(k) out before the work
  if (finish_paired_worker(*poll, requests)) {    // engine_pair.cc
    ++round_;
    return;
  }
  CtrlMessage resp = std::move(ctrl_.receive({0}, what).at(0));
  expect(resp, CtrlType::kResponses, k, rank_);
  ctrl_.flush(what);
  process(decode_responses(resp.payload));
  ++round_;
}

// REQUESTS payload: u8 join | bit vector of cached ids | full metadata list.
std::vector<uint8_t> Engine::encode_requests(const std::vector<Entry>& fresh, bool join) {
  ByteWriter w;
  w.put<uint8_t>(join ? 1 : 0);
  std::vector<uint8_t> bits((cache_.slots() + 7) / 8, 0);
  std::vector<const RequestMeta*> full;
  for (const Entry& e : fresh) {
    if (e.join) continue;
    const int64_t id = cache_.lookup(e.meta);
    if (id >= 0)
      bits[id / 8] |= static_cast<uint8_t>(1u << (id % 8));
    else
      full.push_back(&e.meta);
  }
  w.put_bytes(bits);
  w.put<uint32_t>(static_cast<uint32_t>(full.size()));
  for (const RequestMeta* m : full) m->write(w);
  // then: kind, name, why, process set
  w.put<uint32_t>(static_cast<uint32_t>(rejections_.size()));
  for (const Rejection& rj : rejections_) {
    w.put<uint32_t>(static_cast<uint32_t>(rj.kind));
    w.put_str(rj.name);
    w.put_str(rj.why);
    w.put<uint32_t>(static_cast<uint32_t>(rj.members.size()));
    for (int32_t m : rj.members) w.put<int32_t>(m);
  }
  // then: the process sets this rank joined (join(process_set=))
  std::vector<const std::vector<int32_t>*> sets;
  for (const Entry& e : fresh)
    if (e.join && !e.meta.members.empty()) sets.push_back(&e.meta.members);
  w.put<uint32_t>(static_cast<uint32_t>(sets.size()));
  for (const auto* ms : sets) {
    w.put<uint32_t>(static_cast<uint32_t>(ms->size()));
    for (int32_t m : *ms) w.put<int32_t>(m);
  }
  encode_folds(fresh, w);
  rejections_.clear();
  return std::move(w.bytes());
}

void Engine::decode_requests(int rank, const std::vector<uint8_t>& payload, double t) {
  try {
    decode_requests_from(rank, payload, t);
  } catch (const Error& e) {
    throw Error(e.kind(), cat("rank ", rank_, ": requests of rank ", rank, " in negotiation round ",
                              round_, ": ", e.what()));
  }
}

// A rank's refusals happened before its submissions in the same message: a
// refused call raised before its caller could call again, and a refusal of a
// name in flight is never sent (reject_locked).
void Engine::decode_requests_from(int rank, const std::vector<uint8_t>& payload, double t) {
  ByteReader r(payload.data(), payload.size());
  const bool join = r.get<uint8_t>() != 0;
  std::vector<RequestMeta> submitted;
  std::vector<uint8_t> bits = r.get_bytes();
  for (size_t byte = 0; byte < bits.size(); ++byte)  // mostly zero bytes
    for (unsigned b = bits[byte]; b; b &= b - 1)
      submitted.push_back(cache_.at(static_cast<uint32_t>(byte * 8 + __builtin_ctz(b))));
  const uint32_t n = r.get<uint32_t>();
  for (uint32_t i = 0; i < n; ++i) submitted.push_back(RequestMeta::read(r));
  std::vector<Rejection> refused(r.get<uint32_t>());
  for (Rejection& rj : refused) {
    rj.kind = static_cast<CollKind>(r.get<uint32_t>());
    rj.name = r.get_str();
    rj.why = r.get_str();
    rj.members.resize(r.get<uint32_t>());
    for (int32_t& m : rj.members) m = r.get<int32_t>();
  }
  submit_in_order(rank, std::move(submitted), refused, t);
  const uint32_t sets = r.get<uint32_t>();
  for (uint32_t i = 0; i < sets; ++i) {
    std::vector<int32_t> members(r.get<uint32_t>());
    for (int32_t& m : members) m = r.get<int32_t>();
    negotiator_->join(rank, t, members);
  }
  decode_folds(rank, r);
  if (join) negotiator_->join(rank, t);
}

// RESPONSES payload: per response its fields, per tensor a cache id or -1
// followed by the full metadata.
std::vector<uint8_t> Engine::encode_responses(const std::vector<Response>& rs) const {
  ByteWriter w;
  w.put<uint32_t>(static_cast<uint32_t>(rs.size()));
  for (const Response& r : rs) {
    w.put<uint8_t>(static_cast<uint8_t>(r.type));
    w.put<int32_t>(r.contributors);
    w.put<int32_t>(r.last_joined);
    w.put<uint8_t>(static_cast<uint8_t>(r.error_kind));
    w.put_str(r.message);
    w.put<uint32_t>(static_cast<uint32_t>(r.tensors.size()));
    for (const RequestMeta& m : r.tensors) {
      const int64_t id = cache_.lookup(m);
      w.put<int64_t>(id);
      if (id < 0) m.write(w);
    }
    w.put<uint8_t>(r.folded ? 1 : 0);
    if (r.folded) w.put_bytes(r.result);
  }
  return std::move(w.bytes());
}

std::vector<Response> Engine::decode_responses(const std::vector<uint8_t>& payload) const {
  try {
    return decode_responses_from(payload);
  } catch (const Error& e) {
    throw Error(e.kind(), cat("rank ", rank_, ": responses of rank 0 in negotiation round ", round_,
                              ": ", e.what()));
  }
}

std::vector<Response> Engine::decode_responses_from(const std::vector<uint8_t>& payload) const {
  ByteReader rd(payload.data(), payload.size());
  std::vector<Response> rs(rd.get<uint32_t>());
  for (Response& r : rs) {
    r.type = static_cast<RespType>(rd.get<uint8_t>());
    r.contributors = rd.get<int32_t>();
    r.last_joined = rd.get<int32_t>();
    r.error_kind = static_cast<ErrorKind>(rd.get<uint8_t>());
    r.message = rd.get_str();
    r.tensors.resize(rd.get<uint32_t>());
    for (RequestMeta& m : r.tensors) {
      const int64_t id = rd.get<int64_t>();
      m = id >= 0 ? cache_.at(static_cast<uint32_t>(id)) : RequestMeta::read(rd);
    }
    r.folded = rd.get<uint8_t>() != 0;
    if (r.folded) r.result = rd.get_bytes();
  }
  return rs;
}

// Every rank processes the same list in the same order: that keeps the data
// streams and the response caches in step.
void Engine::process(const std::vector<Response>& rs) {
  for (const Response& r : rs) {
    switch (r.type) {
      case RespType::kExec:
        // Counted first: a caller woken by the handles may read the stats.
        executed_responses_.fetch_add(1, std::memory_order_relaxed);
        executed_tensors_.fetch_add(r.tensors.size(), std::memory_order_relaxed);
        if (tuner_ && tuner_->observe(r.tensors, now())) retune();  // engine_tune.cc
        if (r.folded)
          finish_folded(r);
        else
          execute(r);
        for (const RequestMeta& m : r.tensors) cache_.put(m);
        break;
      case RespType::kError: fail_entries(r, r.error_kind, r.message); break;
      case RespType::kJoinDone: finish_join(r); break;
      case RespType::kStallWarning: log(LogLevel::kWarning, rank_, r.message); break;
      case RespType::kFatal: throw Error(r.error_kind, cat("rank ", rank_, ": ", r.message));
    }
  }
}

// Every rank (of the job, or of the process set the response names) has
// joined. Before join() returns, unnamed calls (of the set) start a new
// epoch (see enqueue_locked), so that all ranks name them alike again.
void Engine::finish_join(const Response& r) {
  const std::vector<int32_t> none;
  const std::vector<int32_t>& set = r.tensors.empty() ? none : r.tensors.front().members;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (set.empty()) {
      ++join_epoch_;
      noname_ = 0;
      noname_sets_.clear();
    } else {
      ++set_join_epochs_[set];
      noname_sets_.erase(set);
    }
  }
  auto done = std::stable_partition(joins_.begin(), joins_.end(),
                                    [&](const Entry& j) { return j.meta.members != set; });
  for (auto j = done; j != joins_.end(); ++j) {
    j->handle->join_result = r.last_joined;
    j->handle->resolve_one();
  }
  joins_.erase(done, joins_.end());
  if (set.empty())
    joined_ = false;
  else
    joined_sets_.erase(std::remove(joined_sets_.begin(), joined_sets_.end(), set),
                       joined_sets_.end());
}

bool Engine::joined(const std::vector<int32_t>& members) const {
  return joined_ || (!members.empty() && std::find(joined_sets_.begin(), joined_sets_.end(),
                                                   members) != joined_sets_.end());
}

// Every rank sees every response; a process set's run on its members only.
void Engine::execute(const Response& r) {
  if (!r.tensors.front().has_rank(rank_)) return;
  std::vector<Entry*> local;
  for (const RequestMeta& m : r.tensors) {
    auto it = pending_.find(m.name);
    if (it == pending_.end() && !joined(r.tensors.front().members))
      throw_error(ErrorKind::kInternal, "rank ", rank_, ": told to run '", m.name,
                  "', which this rank never submitted");
    local.push_back(it == pending_.end() ? nullptr : &it->second);
  }
  // Each rank's own GPU: ranks agree only that the tensors are on a GPU
  // (compatible() in request.cc), rank r typically uses GPU local_rank. A
  // joined rank has no tensor here: on GPU it takes part through the GPU
  // executor it already has, else on the GPU its join() named (another rank's
  // ordinal, the response's, would put two ranks of one host on one GPU).
  int32_t device = r.tensors.front().device;
  Executor* ex = nullptr;
  for (Entry* e : local)
    if (e) {
      device = e->meta.device;
      break;
    }
  if (device >= 0 && std::none_of(local.begin(), local.end(), [](Entry* e) { return e; })) {
    for (auto& x : executors_)
      if (!x->handles(-1)) {
        ex = x.get();
        break;
      }
    if (!ex && join_device_ >= 0) device = join_device_;
  }
  bool done;
  try {
    done = (ex ? *ex : executor_for(r, device)).execute(r, local);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kMismatch && e.kind() != ErrorKind::kInvalidArgument) throw;
    fail_entries(r, e.kind(), e.what());
    return;
  }
  if (!done) return;  // enqueued: poll_executors() completes it
  std::vector<std::string> names;
  for (Entry* e : local)
    if (e) names.push_back(e->meta.name);
  resolve_names(names);
}

// The executor whose handles(device) is true, made on first use for a GPU.
// When none can be made, every later response for that device fails with
// the same reason (kInvalidArgument: the entries fail, the engine goes on).
Executor& Engine::executor_for(const Response& r, int32_t device) {
  for (auto& ex : executors_)
    if (ex->handles(device)) return *ex;
  auto it = unusable_.find(device);
  if (it == unusable_.end()) {
    ExecutorFactory factory;
    {
      std::lock_guard<std::mutex> lock(mu_);
      factory = device_factory_;
    }
    try {
      std::unique_ptr<Executor> ex =
          factory ? factory(device) : make_device_executor(*ctx_, device);
      if (!ex || !ex->handles(device))
        throw_error(ErrorKind::kInternal, "no executor handles device ", device);
      ex->set_waker(waker_);
      executors_.push_back(std::move(ex));
      async_ = true;
      if (device >= 0 && gpu_device_.load() < 0) gpu_device_.store(device);
      return *executors_.back();
    } catch (const Error& e) {
      it = unusable_.emplace(device, e.what()).first;
    }
  }
  const RequestMeta& m = r.tensors.front();
  throw_error(ErrorKind::kInvalidArgument, "rank ", rank_, ": ", coll_name(m.kind), " '", m.name,
              "': the tensor is on GPU ", device, ", which this process cannot use: ", it->second);
}

bool Engine::async_busy() const {
  if (!async_) return false;
  for (const auto& ex : executors_)
    if (ex->busy()) return true;
  return false;
}

// A failed completion means a broken device or communicator (a CUDA error,
// an NCCL asynchronous error): the peers' NCCL calls may wait for this rank
// forever (over P2P or NVLink nothing tells them), so the engine fails as a
// whole and its last words reach every peer (fail_engine -> Context::
// mark_broken), as when a rank dies; its own calls fail with the message.
void Engine::poll_executors() {
  device_done_.store(false);  // before the polls: a ring after them is seen by block()
  std::optional<Error> broken;
  for (auto& ex : executors_) {
    if (!ex->busy()) continue;
    for (Completion& c : ex->poll()) {
      if (c.ok) {
        resolve_names(c.names);
        continue;
      }
      fail_names(c.names, c.kind, c.message);
      if (!broken)
        broken.emplace(c.kind, c.message.rfind("rank ", 0) == 0
                                   ? c.message
                                   : cat("rank ", rank_, ": ", c.message));
    }
  }
  if (broken) fail_engine(*broken);
}

// Names are released (one lock for the response) before handles resolve:
// a caller that saw its handle complete may submit the name again at once.
void Engine::resolve_names(const std::vector<std::string>& names) {
  std::vector<std::shared_ptr<HandleState>> done;
  std::vector<std::string> found;
  for (const std::string& n : names) {
    auto it = pending_.find(n);
    if (it == pending_.end()) continue;  // failed meanwhile (shutdown)
    done.push_back(std::move(it->second.handle));
    found.push_back(n);
    pending_.erase(it);
  }
  release_names(found);
  HandleState::resolve_all(done);
}

void Engine::fail_names(const std::vector<std::string>& names, ErrorKind kind,
                        const std::string& msg) {
  const std::string text = msg.rfind("rank ", 0) == 0 ? msg : cat("rank ", rank_, ": ", msg);
  std::vector<std::shared_ptr<HandleState>> failed;
  std::vector<std::string> found;
  for (const std::string& n : names) {
    auto it = pending_.find(n);
    if (it == pending_.end()) continue;
    failed.push_back(std::move(it->second.handle));
    found.push_back(n);
    pending_.erase(it);
  }
  release_names(found);
  for (auto& h : failed) h->fail_one(kind, text);
}

void Engine::fail_entries(const Response& r, ErrorKind kind, const std::string& msg) {
  std::vector<std::string> names;
  for (const RequestMeta& m : r.tensors) {
    auto refused = refused_names_.find(m.name);
    if (r.type == RespType::kError && refused != refused_names_.end()) {
      refused_names_.erase(refused);  // this rank's caller got its error when it refused
      continue;
    }
    names.push_back(m.name);
  }
  fail_names(names, kind, msg);
}

}  // namespace rr
