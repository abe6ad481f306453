// The host-memory executor. A response of one allreduce runs in place on the
// caller's buffers. A fused response above the small-message size is reduced
// in place too, as one ring over all its tensors (collectives/segments.h);
// a small one, or one on a rank that joined (neutral elements to supply), is
// packed into the fusion buffer, reduced once and unpacked. Both forms put
// the same bytes on the wire, so ranks may differ in which they use.
// The executor applies prescale factors itself, to real inputs only, and runs
// every collective with prescale 1 on every rank: a joined rank's neutral
// elements must stay neutral (2 x 1 is no identity for Product), and the
// collectives' header check still sees equal arguments everywhere.
// With joined ranks, Average runs as Sum and is divided by the number of
// contributors afterwards, identically on every rank. Adasum packs its
// tensors and their boundaries for its own algorithm (allreduce_adasum).
#include <algorithm>
#include <cstring>
#include <limits>

#include "collectives/collective_util.h"
#include "collectives/collectives.h"
#include "collectives/segments.h"
#include "coordination/executor.h"
#include "coordination/timeline.h"

namespace rr {

namespace {

template <typename T>
void fill(void* buf, size_t count, T v) {
  auto* p = static_cast<T*>(buf);
  for (size_t i = 0; i < count; ++i) p[i] = v;
}

class CpuExecutor : public Executor {
 public:
  CpuExecutor(Context& ctx, Timeline* timeline) : root_(ctx), ctx_(&ctx), timeline_(timeline) {}

  bool handles(int32_t device) const override { return device < 0; }

  bool execute(const Response& r, const std::vector<Entry*>& local) override {
    const RequestMeta& m = r.tensors.front();
    // A process set runs over its members' view of the links: its own ring.
    ctx_ = m.members.empty() ? &root_ : &root_.group(m.members);
    const bool traced = timeline_ && timeline_->active();
    if (traced) start_activity(r, cat(coll_name(m.kind)));
    switch (m.kind) {
      case CollKind::kAllreduce:
        if (m.op == ReduceOp::kAdasum)
          allreduce_adasum(r, local);
        else if (r.tensors.size() == 1)
          allreduce_one(r, local[0]);
        else if (in_place_ok(r, local))
          allreduce_segmented(r, local);
        else
          allreduce_fused(r, local);
        break;
      case CollKind::kAllgather: gather(m, local[0]); break;
      case CollKind::kBroadcast: bcast(m, local[0]); break;
      case CollKind::kReducescatter: scatter(m, local[0]); break;
      case CollKind::kAlltoall: exchange(m, local[0]); break;
      case CollKind::kBarrier: barrier(*ctx_, m.name); break;
    }
    if (traced) end_activity(r);
    return true;
  }

 private:
  // Average over fewer ranks than the job has: reduce as Sum, divide after.
  // `postscale` is what the collective applies (the rest comes with the
  // division afterwards).
  struct Plan {
    ReduceOp op;
    bool divide_after;
    double postscale;
  };
  Plan plan(const Response& r) const {
    const RequestMeta& m = r.tensors.front();
    if (m.op == ReduceOp::kAverage && r.contributors < ctx_->size())
      return {ReduceOp::kSum, true, 1.0};
    return {m.op, false, m.postscale};
  }
  void finish(const Response& r, const Plan& p, void* buf, size_t count) const {
    const RequestMeta& m = r.tensors.front();
    if (p.divide_after)
      finalize_reduction(buf, count, m.dtype, ReduceOp::kAverage, m.postscale, r.contributors);
  }

  void allreduce_one(const Response& r, Entry* e) {
    const RequestMeta& m = r.tensors.front();
    const size_t count = static_cast<size_t>(num_elements(m.shape));
    const Plan p = plan(r);
    const void* in = e ? e->in : neutral(m, p.op, count);
    void* out = e ? e->out : ctx_->scratch(2, m.bytes());
    if (e && m.prescale != 1.0) {
      if (out != in && m.bytes()) std::memcpy(out, in, m.bytes());
      apply_prescale(out, count, m.dtype, m.prescale);
      in = out;
    }
    allreduce(*ctx_, Tensor{in, m.shape, m.dtype, m.name}, out, p.op, 1.0, p.postscale);
    finish(r, p, out, count);
  }

  void allreduce_fused(const Response& r, const std::vector<Entry*>& local) {
    const RequestMeta& m = r.tensors.front();
    const size_t es = dtype_size(m.dtype);
    std::vector<size_t> off(r.tensors.size() + 1, 0);
    for (size_t i = 0; i < r.tensors.size(); ++i) off[i + 1] = off[i] + r.tensors[i].bytes();
    uint8_t* buf = fusion(off.back());
    const Plan p = plan(r);
    phase("MEMCPY_IN_FUSION_BUFFER");
    for (size_t i = 0; i < r.tensors.size(); ++i) {
      const size_t n = r.tensors[i].bytes();
      if (local[i]) {
        if (n) std::memcpy(buf + off[i], local[i]->in, n);
        apply_prescale(buf + off[i], n / es, m.dtype, m.prescale);
      } else {
        fill_identity(buf + off[i], n / es, m.dtype, p.op);
      }
    }
    const size_t count = off.back() / es;
    allreduce(*ctx_,
              Tensor{buf,
                     {static_cast<int64_t>(count)},
                     m.dtype,
                     cat(m.name, "+", r.tensors.size() - 1, " fused")},
              buf, p.op, 1.0, p.postscale);
    finish(r, p, buf, count);
    phase("MEMCPY_OUT_FUSION_BUFFER");
    for (size_t i = 0; i < r.tensors.size(); ++i)
      if (local[i] && r.tensors[i].bytes())
        std::memcpy(local[i]->out, buf + off[i], r.tensors[i].bytes());
  }

  // In place needs every tensor here (no neutral elements to supply), a total
  // past the direct path, and outputs that do not overlap (one array passed
  // under two names would otherwise be reduced twice).
  bool in_place_ok(const Response& r, const std::vector<Entry*>& local) const {
    size_t total = 0;
    std::vector<std::pair<uintptr_t, uintptr_t>> spans;
    for (size_t i = 0; i < r.tensors.size(); ++i) {
      if (!local[i]) return false;
      const auto* b = static_cast<const uint8_t*>(local[i]->out);
      spans.emplace_back(reinterpret_cast<uintptr_t>(b),
                         reinterpret_cast<uintptr_t>(b + r.tensors[i].bytes()));
      total += r.tensors[i].bytes();
    }
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i)
      if (spans[i].first < spans[i - 1].second) return false;
    return total > ctx_->options().small_bytes;
  }

  void allreduce_segmented(const Response& r, const std::vector<Entry*>& local) {
    const RequestMeta& m = r.tensors.front();
    Segments segs;
    const bool copies =
        std::any_of(local.begin(), local.end(), [](const Entry* e) { return e->out != e->in; });
    if (copies || m.prescale != 1.0) phase("COPY_OUT_OF_PLACE_INPUTS");
    for (size_t i = 0; i < r.tensors.size(); ++i) {
      Entry* e = local[i];
      const size_t n = r.tensors[i].bytes();
      if (e->out != e->in && n) std::memcpy(e->out, e->in, n);
      apply_prescale(e->out, n / dtype_size(m.dtype), m.dtype, m.prescale);
      segs.add(static_cast<uint8_t*>(e->out), n);
    }
    const Plan p = plan(r);
    allreduce_segments(*ctx_, segs, m.dtype, p.op, p.postscale,
                       cat(m.name, "+", r.tensors.size() - 1, " fused"));
    if (p.divide_after)
      segs.for_each(0, segs.bytes(), [&](uint8_t* q, size_t, size_t len) {
        finish(r, p, q, len / dtype_size(m.dtype));
      });
  }

  // Adasum combines each tensor on its own: the tensors are packed (prescaled;
  // a joined rank's as zeros, which Adasum passes through: adasum(a, 0) = a)
  // and their element counts go with them (collectives/allreduce_adasum.cc).
  // One tensor present here runs in its output, without the fusion buffer.
  void allreduce_adasum(const Response& r, const std::vector<Entry*>& local) {
    const RequestMeta& m = r.tensors.front();
    const size_t es = dtype_size(m.dtype);
    std::vector<size_t> counts;
    size_t total = 0;
    for (const auto& t : r.tensors) {
      counts.push_back(t.bytes() / es);
      total += t.bytes();
    }
    const bool direct = r.tensors.size() == 1 && local[0];
    auto* buf = direct ? static_cast<uint8_t*>(local[0]->out) : fusion(total);
    // Without prescale a lone tensor is read where it lies (out of place, the
    // first level reads the input and writes only the output).
    const bool read_input = direct && m.prescale == 1.0;
    const void* in = read_input ? local[0]->in : buf;
    if (!direct) phase("MEMCPY_IN_FUSION_BUFFER");
    for (size_t i = 0, off = 0; !read_input && i < r.tensors.size();
         off += r.tensors[i].bytes(), ++i) {
      const size_t n = r.tensors[i].bytes();
      if (!local[i]) {
        std::memset(buf + off, 0, n);
        continue;
      }
      if (n && buf + off != local[i]->in) std::memcpy(buf + off, local[i]->in, n);
      apply_prescale(buf + off, n / es, m.dtype, m.prescale);
    }
    // Not `direct`: a joined rank packs even a single tensor, and names must agree.
    const std::string name =
        r.tensors.size() == 1 ? m.name : cat(m.name, "+", r.tensors.size() - 1, " fused");
    adasum(*ctx_, buf, Tensor{in, {static_cast<int64_t>(total / es)}, m.dtype, name}, counts,
           m.postscale);
    if (direct) return;
    phase("MEMCPY_OUT_FUSION_BUFFER");
    for (size_t i = 0, off = 0; i < r.tensors.size(); off += r.tensors[i].bytes(), ++i)
      if (local[i] && r.tensors[i].bytes())
        std::memcpy(local[i]->out, buf + off, r.tensors[i].bytes());
  }

  void gather(const RequestMeta& m, Entry* e) {
    std::vector<int64_t> shape = e ? e->meta.shape : m.shape;
    if (!e) shape[0] = 0;
    OwnedBuffer result;
    allgather(*ctx_, Tensor{e ? e->in : nullptr, shape, m.dtype, m.name},
              [&](const std::vector<int64_t>& s) {
                result = allocate_owned(s, m.dtype);
                return static_cast<void*>(result.data.get());
              });
    if (e) e->handle->outputs[e->index] = std::move(result);
  }

  void bcast(const RequestMeta& m, Entry* e) {
    void* buf = e ? e->out : ctx_->scratch(2, m.bytes());
    broadcast(*ctx_, buf, Tensor{buf, m.shape, m.dtype, m.name}, m.root);
  }

  void scatter(const RequestMeta& m, Entry* e) {
    OwnedBuffer result;
    reducescatter(*ctx_, Tensor{e->in, m.shape, m.dtype, m.name}, m.op, m.prescale, m.postscale,
                  [&](const std::vector<int64_t>& s) {
                    result = allocate_owned(s, m.dtype);
                    return static_cast<void*>(result.data.get());
                  });
    e->handle->outputs[e->index] = std::move(result);
  }

  void exchange(const RequestMeta& m, Entry* e) {
    OwnedBuffer result;
    e->handle->received_splits = alltoall(*ctx_, Tensor{e->in, e->meta.shape, m.dtype, m.name},
                                          e->splits, [&](const std::vector<int64_t>& s) {
                                            result = allocate_owned(s, m.dtype);
                                            return static_cast<void*>(result.data.get());
                                          });
    e->handle->outputs[e->index] = std::move(result);
  }

  const void* neutral(const RequestMeta& m, ReduceOp op, size_t count) {
    void* buf = ctx_->scratch(1, m.bytes());
    fill_identity(buf, count, m.dtype, op);
    return buf;
  }

  uint8_t* fusion(size_t bytes) {
    if (fusion_.size() < bytes) fusion_.resize(bytes);  // zero-filled: pages touched once
    return fusion_.data();
  }

  void phase(const char* name) { ctx_->phase(name); }
  void start_activity(const Response& r, const std::string& activity) {
    std::vector<std::string> names;
    for (const auto& t : r.tensors) {
      timeline_->end(t.name);  // closes WAIT, which negotiation opened
      timeline_->begin(t.name, activity);
      names.push_back(t.name);
    }
    timeline_->set_current(names);
  }
  void end_activity(const Response& r) {
    timeline_->set_current({});
    for (const auto& t : r.tensors) timeline_->end(t.name);
  }

  Context& root_;
  Context* ctx_;  // root_, or the response's process set view of it
  Timeline* timeline_;
  std::vector<uint8_t> fusion_;
};

}  // namespace

// The identity of Product (which 0), Min (1) or Max (2) for an integer type.
template <class T>
void fill_limits(void* buf, size_t count, int which) {
  using L = std::numeric_limits<T>;
  fill<T>(buf, count, which == 0 ? T{1} : (which == 1 ? L::max() : L::min()));
}

void fill_identity(void* buf, size_t count, DType dtype, ReduceOp op) {
  if (op == ReduceOp::kSum || op == ReduceOp::kAverage) {
    std::memset(buf, 0, count * dtype_size(dtype));
    return;
  }
  const int which = op == ReduceOp::kProduct ? 0 : (op == ReduceOp::kMin ? 1 : 2);
  switch (dtype) {
    case DType::kUInt8: fill<uint8_t>(buf, count, which == 0 ? 1 : (which == 1 ? 255 : 0)); break;
    case DType::kInt8: fill<int8_t>(buf, count, which == 0 ? 1 : (which == 1 ? 127 : -128)); break;
    case DType::kBool: fill<uint8_t>(buf, count, which == 2 ? 0 : 1); break;
    case DType::kInt32:
      fill<int32_t>(buf, count, which == 0 ? 1 : (which == 1 ? INT32_MAX : INT32_MIN));
      break;
    case DType::kInt64:
      fill<int64_t>(buf, count, which == 0 ? 1 : (which == 1 ? INT64_MAX : INT64_MIN));
      break;
    case DType::kFloat16:  // 1.0, +inf, -inf
      fill<uint16_t>(buf, count, which == 0 ? 0x3C00 : (which == 1 ? 0x7C00 : 0xFC00));
      break;
    case DType::kBFloat16:
      fill<uint16_t>(buf, count, which == 0 ? 0x3F80 : (which == 1 ? 0x7F80 : 0xFF80));
      break;
    case DType::kFloat32: {
      const float inf = std::numeric_limits<float>::infinity();
      fill<float>(buf, count, which == 0 ? 1.0f : (which == 1 ? inf : -inf));
      break;
    }
    case DType::kFloat64: {
      const double inf = std::numeric_limits<double>::infinity();
      fill<double>(buf, count, which == 0 ? 1.0 : (which == 1 ? inf : -inf));
      break;
    }
    case DType::kInt16: fill_limits<int16_t>(buf, count, which); break;
    case DType::kUInt16: fill_limits<uint16_t>(buf, count, which); break;
    case DType::kUInt32: fill_limits<uint32_t>(buf, count, which); break;
    case DType::kUInt64: fill_limits<uint64_t>(buf, count, which); break;
  }
}

std::unique_ptr<Executor> make_cpu_executor(Context& ctx, Timeline* timeline) {
  return std::make_unique<CpuExecutor>(ctx, timeline);
}

}  // namespace rr
