// Bindings of the Engine (the path every collective takes) and, for the unit
// test tier, of its pure-logic parts: Negotiator, fusion planning, response
// cache. No logic: argument conversion, and the GIL released around waits.
#include "bindings/engine_bindings.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "coordination/engine.h"
#include "coordination/fusion.h"
#include "coordination/negotiator.h"
#include "coordination/response_cache.h"

namespace py = pybind11;

namespace rr {
namespace {

uintptr_t address(py::handle obj) {
  if (py::isinstance<py::array>(obj))
    return reinterpret_cast<uintptr_t>(py::reinterpret_borrow<py::array>(obj).data());
  return obj.cast<uintptr_t>();
}

DType dtype_arg(int32_t code) {
  if (!dtype_is_valid(code)) throw_error(ErrorKind::kInvalidArgument, "unknown dtype code ", code);
  return static_cast<DType>(code);
}

ReduceOp op_arg(int32_t code) {
  if (!reduce_op_is_valid(code)) throw_error(ErrorKind::kInvalidArgument, "unknown op code ", code);
  return static_cast<ReduceOp>(code);
}

Entry entry(CollKind kind, py::handle in, py::handle out, std::vector<int64_t> shape, int32_t dtype,
            std::string name) {
  Entry e;
  e.meta.kind = kind;
  e.meta.dtype = dtype_arg(dtype);
  e.meta.shape = std::move(shape);
  e.meta.name = std::move(name);
  e.in = reinterpret_cast<const void*>(address(in));
  e.out = out.is_none() ? nullptr : reinterpret_cast<void*>(address(out));
  return e;
}

// The arguments every reduction carries.
Entry& reducing(Entry& e, int32_t op, double pre, double post) {
  e.meta.op = op_arg(op);
  e.meta.prescale = pre;
  e.meta.postscale = post;
  return e;
}

// A process set's face of the engine (Python's ProcessSet): the same calls,
// every entry stamped with the set's members.
struct SetEngine {
  std::shared_ptr<Engine> eng;
  std::vector<int32_t> members;
};

Engine& engine_of(Engine& e) {
  return e;
}
Engine& engine_of(SetEngine& s) {
  return *s.eng;
}
void stamp(const Engine&, std::vector<Entry>&) {}
void stamp(const SetEngine& s, std::vector<Entry>& es) {
  for (Entry& e : es) e.meta.members = s.members;
}

// Engine::reject with the collective named as Python names it.
void reject_call(Engine& eng, const std::vector<int32_t>& members, const std::string& kind,
                 const std::string& name, const std::string& why) {
  for (uint32_t k = 1; k <= static_cast<uint32_t>(CollKind::kBarrier); ++k)
    if (kind == coll_name(static_cast<CollKind>(k)))
      return eng.reject(static_cast<CollKind>(k), name, why, members);
  throw_error(ErrorKind::kInvalidArgument, "no collective is called '", kind, "'");
}

template <class T>
std::shared_ptr<HandleState> submit_all(T& target, std::vector<Entry> es) {
  stamp(target, es);
  py::gil_scoped_release nogil;  // submit may wait for the engine's queue lock
  return engine_of(target).submit(std::move(es));
}

template <class T>
std::shared_ptr<HandleState> submit_one(T& target, Entry e) {
  std::vector<Entry> v;
  v.push_back(std::move(e));
  return submit_all(target, std::move(v));
}

// The core's code for a numpy dtype that every path handles alike, or -1
// (extension and non-native dtypes: the general path decides and words it).
int32_t plain_dtype_code(const py::dtype& dt) {
  struct Plain {
    char kind;
    py::ssize_t size;
    DType dtype;
  };
  static constexpr Plain kPlain[] = {
      {'f', 2, DType::kFloat16}, {'f', 4, DType::kFloat32}, {'f', 8, DType::kFloat64},
      {'i', 1, DType::kInt8},    {'i', 4, DType::kInt32},   {'i', 8, DType::kInt64},
      {'u', 1, DType::kUInt8},   {'b', 1, DType::kBool},    {'i', 2, DType::kInt16},
      {'u', 2, DType::kUInt16},  {'u', 4, DType::kUInt32},  {'u', 8, DType::kUInt64}};
  if (dt.byteorder() != '=' && dt.byteorder() != '|') return -1;
  const char kind = dt.kind();
  const py::ssize_t size = dt.itemsize();
  for (const Plain& p : kPlain)
    if (p.kind == kind && p.size == size) return static_cast<int32_t>(p.dtype);
  return -1;
}

// A completed handle (the common case in a synchronize loop after the last
// one) needs no GIL hand-off. Otherwise the wait runs in slices without the
// GIL, and between slices the main thread runs Python's signal handlers, so
// Ctrl-C (KeyboardInterrupt) ends a wait for a peer that never comes. The
// collective itself stays in flight; the handle can be waited for again.
void wait_state(HandleState& h) {
  constexpr int64_t kSignalCheckNs = 100'000'000;
  for (;;) {
    if (h.done()) return h.rethrow();
    bool finished;
    {
      py::gil_scoped_release nogil;
      finished = h.wait_for(kSignalCheckNs);
    }
    if (finished) return h.rethrow();
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

py::object wait_array(ArrayHandle& h) {
  wait_state(*h.state);
  return h.array;
}

// An entry of `kind` reading `x` and writing `out` if `x` is a C-contiguous numpy
// array of a plain dtype, writable if `writable`; false otherwise (the general path
// converts or raises with context).
bool plain_entry_named(CollKind kind, py::handle x, std::string name, bool writable, py::handle out,
                       Entry* e) {
  if (!py::isinstance<py::array>(x)) return false;
  const auto arr = py::reinterpret_borrow<py::array>(x);
  if (!(arr.flags() & py::array::c_style) || (writable && !arr.writeable())) return false;
  const int32_t code = plain_dtype_code(arr.dtype());
  if (code < 0) return false;
  *e = entry(kind, x, out, std::vector<int64_t>(arr.shape(), arr.shape() + arr.ndim()), code,
             std::move(name));
  return true;
}

// An allreduce entry for `x` (`result` None: in place, so `x` must be writable; else
// an array like `x` for the result).
bool plain_array_entry(py::handle x, std::string name, int32_t op, double pre, double post,
                       Entry* out, py::handle result = py::none()) {
  const bool in_place = result.is_none();
  if (!plain_entry_named(CollKind::kAllreduce, x, std::move(name), in_place, in_place ? x : result,
                         out))
    return false;
  reducing(*out, op, pre, post);
  return true;
}

// An uninitialised C-contiguous array, its data 64-byte aligned (what
// TensorFlow needs to adopt memory without a copy; Python's OutputPool makes
// large results, this the small ones).
py::array aligned_array(const py::dtype& dtype, std::vector<py::ssize_t> shape) {
  constexpr size_t kAlign = 64;
  size_t bytes = static_cast<size_t>(dtype.itemsize());
  for (py::ssize_t d : shape) bytes *= static_cast<size_t>(d);
  bytes = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, bytes ? bytes : kAlign);
  if (!p) throw std::bad_alloc();
  py::capsule owner(p, [](void* q) { std::free(q); });
  return py::array(dtype, std::move(shape), p, owner);
}

py::array aligned_empty_like(const py::array& a) {
  return aligned_array(a.dtype(), std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim()));
}

// The op code, if `op` is a Python int naming a valid op (anything else goes
// to the general path, which says what is wrong with it).
bool op_code(py::handle op, int32_t* out) {
  if (!PyLong_Check(op.ptr())) return false;
  int overflow = 0;
  const long v = PyLong_AsLongAndOverflow(op.ptr(), &overflow);
  if (overflow != 0 || v < 0 || v > INT32_MAX || !reduce_op_is_valid(static_cast<int32_t>(v)))
    return false;
  *out = static_cast<int32_t>(v);
  return true;
}

// The scale factors, if both are finite Python floats or ints, exactly (a float
// subclass may convert differently: the general path converts what it can or
// says what is wrong).
bool scale_args(py::handle pre_obj, py::handle post_obj, double* pre, double* post) {
  auto one = [](py::handle h, double* out) {
    if (PyFloat_CheckExact(h.ptr()))
      *out = PyFloat_AsDouble(h.ptr());
    else if (PyLong_CheckExact(h.ptr()))
      *out = PyLong_AsDouble(h.ptr());
    else
      return false;
    if (PyErr_Occurred()) {  // an int too large for a double
      PyErr_Clear();
      return false;
    }
    return std::isfinite(*out);
  };
  return one(pre_obj, pre) && one(post_obj, post);
}

// The entry of an allreduce of plain numpy array `x` (into `result`, or in place
// when None) if the arguments need no conversion; false sends the call to the
// general path, which converts what it can or says what is wrong.
bool plain_allreduce(py::handle x, py::handle op_obj, py::handle name, py::handle pre_obj,
                     py::handle post_obj, Entry* e, py::handle result = py::none()) {
  int32_t op = 0;
  double pre = 1, post = 1;
  return op_code(op_obj, &op) && (name.is_none() || PyUnicode_CheckExact(name.ptr())) &&
         scale_args(pre_obj, post_obj, &pre, &post) &&
         plain_array_entry(x, name.is_none() ? std::string() : name.cast<std::string>(), op, pre,
                           post, e, result);
}

// allreduce_async_ of a plain numpy array, with the Python-side checks done
// here (the hot path: one call per gradient). Returns None when the array or
// an argument needs the general path.
template <class T>
py::object allreduce_array(T& eng, py::handle x, py::handle op_obj, py::handle name,
                           py::handle pre_obj, py::handle post_obj) {
  Entry e;
  if (!plain_allreduce(x, op_obj, name, pre_obj, post_obj, &e)) return py::none();
  return py::cast(ArrayHandle{submit_one(eng, std::move(e)), py::reinterpret_borrow<py::object>(x),
                              py::none()});
}

// The engine-allocated result `i` of `h` as an array that owns the memory:
// of `dtype` in the collective's shape, or (`flat`) as flat bytes.
py::array owned_array(HandleState& h, size_t i, const py::dtype& dtype, bool flat = false) {
  if (i >= h.outputs.size() || !h.outputs[i].data)
    throw_error(ErrorKind::kInternal, "no engine-allocated output ", i);
  const OwnedBuffer& o = h.outputs[i];
  auto* keep = new std::shared_ptr<uint8_t>(o.data);
  py::capsule owner(keep, [](void* p) { delete static_cast<std::shared_ptr<uint8_t>*>(p); });
  std::vector<py::ssize_t> shape(o.shape.begin(), o.shape.end());
  if (flat) shape = {static_cast<py::ssize_t>(o.bytes)};
  return py::array(dtype, std::move(shape), o.data.get(), owner);
}

// plain_entry_named with the name as Python passed it (None or a str; anything else:
// false, for the general path).
bool plain_entry(CollKind kind, py::handle x, py::handle name, bool writable, py::handle out,
                 Entry* e) {
  return (name.is_none() || PyUnicode_CheckExact(name.ptr())) &&
         plain_entry_named(kind, x, name.is_none() ? std::string() : name.cast<std::string>(),
                           writable, out, e);
}

int set_size(Engine& e) {
  return e.context().size();
}
int set_size(SetEngine& s) {
  return static_cast<int>(s.members.size());
}

// Waits for a blocking fast path's handle; a wait that a signal interrupts
// hands the handle to `keep` (the caller's arrays are still in use).
template <class H>
void wait_now(const H& h, HandleState& state, py::handle keep) {
  try {
    wait_state(state);
  } catch (py::error_already_set&) {
    if (!state.done()) keep.attr("append")(py::cast(h));
    throw;
  }
}

// Blocking broadcast of a plain numpy array (allreduce_array_now's contract):
// in place returns `x`; out of place a new array of at most `max_new` bytes.
// None when an argument needs the general path (which words what is wrong).
template <class T>
py::object broadcast_array_now(T& eng, py::handle x, py::handle root_obj, py::handle name,
                               py::handle keep, bool in_place, size_t max_new) {
  if (!py::isinstance<py::array>(x) || !PyLong_CheckExact(root_obj.ptr())) return py::none();
  int overflow = 0;
  const long root = PyLong_AsLongAndOverflow(root_obj.ptr(), &overflow);
  if (overflow != 0 || root < 0 || root >= set_size(eng)) return py::none();
  const auto arr = py::reinterpret_borrow<py::array>(x);
  if (plain_dtype_code(arr.dtype()) < 0 || !(name.is_none() || PyUnicode_CheckExact(name.ptr())))
    return py::none();  // before any copy: the general path words what is wrong
  py::object buf = py::reinterpret_borrow<py::object>(x);
  if (!in_place) {
    if (static_cast<size_t>(arr.nbytes()) > max_new || !(arr.flags() & py::array::c_style))
      return py::none();
    py::array copy = aligned_empty_like(arr);
    if (arr.nbytes() > 0) std::memcpy(copy.mutable_data(), arr.data(), arr.nbytes());
    buf = std::move(copy);
  }
  Entry e;
  if (!plain_entry(CollKind::kBroadcast, buf, name, true, buf, &e)) return py::none();
  e.meta.root = static_cast<int32_t>(root);
  ArrayHandle h{submit_one(eng, std::move(e)), buf, py::none()};
  wait_now(h, *h.state, keep);
  return h.array;
}

// Blocking allgather of a plain numpy array of at least one dimension: the
// result, a new array of its dtype. None: the general path must take it.
template <class T>
py::object allgather_array_now(T& eng, py::handle x, py::handle name, py::handle keep) {
  Entry e;
  if (!plain_entry(CollKind::kAllgather, x, name, false, py::none(), &e) || e.meta.shape.empty())
    return py::none();
  const py::dtype dtype = py::reinterpret_borrow<py::array>(x).dtype();
  ArrayHandle h{submit_one(eng, std::move(e)), py::none(), py::reinterpret_borrow<py::object>(x)};
  wait_now(h, *h.state, keep);
  return owned_array(*h.state, 0, dtype);
}

// Blocking allreduces of a plain numpy array, checked, submitted and waited
// for in one call (metrics, losses, counts). The caller's frame keeps its
// arrays alive, so no keep-alive handle is made; only a wait that a signal
// interrupts (Ctrl-C) hands its handle to `keep` (the Communicator's list of
// calls in flight), because the collective still uses the arrays.
// In place (`in_place`): returns `x`. Out of place: returns a new array, for
// inputs of at most `max_new` bytes (larger results come from Python's
// OutputPool). None when the array or an argument needs the general path.
template <class T>
py::object allreduce_array_now(T& eng, py::handle x, py::handle op_obj, py::handle name,
                               py::handle pre_obj, py::handle post_obj, py::handle keep,
                               bool in_place, size_t max_new) {
  if (!py::isinstance<py::array>(x)) return py::none();
  py::object result = py::none();
  if (!in_place) {
    const auto arr = py::reinterpret_borrow<py::array>(x);
    if (static_cast<size_t>(arr.nbytes()) > max_new) return py::none();
    result = aligned_empty_like(arr);
  }
  Entry e;
  if (!plain_allreduce(x, op_obj, name, pre_obj, post_obj, &e, result)) return py::none();
  const py::object input = py::reinterpret_borrow<py::object>(x);
  ArrayHandle h{submit_one(eng, std::move(e)), in_place ? input : result, input};
  wait_now(h, *h.state, keep);
  return h.array;
}

// grouped_allreduce_async_ of a non-empty tuple of plain numpy arrays, member
// i named "<group>.<i>": the per-member checks of allreduce_array, with no
// Python per member. Returns None when any member needs the general path.
// A tuple, which the caller keeps until the collective completes: nothing can
// drop a member while the GIL is released below (a list could lose one).
template <class T>
py::object grouped_allreduce_arrays(T& eng, py::handle xs, py::handle op_obj,
                                    const std::string& group, py::handle pre_obj,
                                    py::handle post_obj) {
  int32_t op = 0;
  double pre = 1, post = 1;
  if (!PyTuple_CheckExact(xs.ptr()) || !op_code(op_obj, &op) ||
      !scale_args(pre_obj, post_obj, &pre, &post))
    return py::none();
  const auto members = py::reinterpret_borrow<py::tuple>(xs);
  if (members.empty()) return py::none();
  std::vector<Entry> es(members.size());
  for (size_t i = 0; i < members.size(); ++i) {
    if (!plain_array_entry(members[i], group + "." + std::to_string(i), op, pre, post, &es[i]))
      return py::none();
    es[i].meta.group = group;
  }
  return py::cast(submit_all(eng, std::move(es)));
}

// _arrays.empty_aligned's memory: numpy takes microseconds to make an aligned slice.
py::array aligned_bytes(size_t bytes) {
  return aligned_array(py::dtype("uint8"), {static_cast<py::ssize_t>(bytes)});
}

void bind_handle(py::module_& m) {
  m.def("aligned_bytes", &aligned_bytes);
  py::class_<HandleState, std::shared_ptr<HandleState>>(m, "Handle")
      .def("wait", &wait_state)
      .def("done", &HandleState::done)
      .def("output",
           [](HandleState& h, size_t i) { return owned_array(h, i, py::dtype("uint8"), true); })
      .def("output_shape", [](HandleState& h, size_t i) { return h.outputs.at(i).shape; })
      .def_readonly("received_splits", &HandleState::received_splits)
      .def_readonly("join_result", &HandleState::join_result);
  py::class_<ArrayHandle>(m, "ArrayHandle")
      .def("wait", &wait_array)
      .def("done", [](const ArrayHandle& h) { return h.state->done(); })
      // The completion alone (a Handle), without the arrays it keeps alive.
      .def_readonly("state", &ArrayHandle::state);
}

// A shared buffer as a flat writable byte buffer; numpy views of it keep it
// (and so every rank's mapping of it) alive.
void bind_shared_buffer(py::module_& m) {
  py::class_<SharedRegion, std::shared_ptr<SharedRegion>>(m, "SharedBuffer", py::buffer_protocol())
      .def_buffer([](SharedRegion& r) {
        return py::buffer_info(r.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(r.bytes())}, {1}, false);
      })
      .def_property_readonly("id", &SharedRegion::id)
      .def_property_readonly("nbytes", &SharedRegion::bytes);
}

// The collectives, on the engine and on a process set's view of it.
template <class T>
void def_collectives(py::class_<T, std::shared_ptr<T>>& c) {
  c.def("allreduce",
        [](T& eng, py::handle in, py::handle out, std::vector<int64_t> shape, int32_t dtype,
           int32_t op, double pre, double post, std::string name) {
          Entry e = entry(CollKind::kAllreduce, in, out, std::move(shape), dtype, std::move(name));
          return submit_one(eng, std::move(reducing(e, op, pre, post)));
        })
      .def("allreduce_array", &allreduce_array<T>)
      .def("allreduce_array_now", &allreduce_array_now<T>)
      .def("broadcast_array_now", &broadcast_array_now<T>)
      .def("allgather_array_now", &allgather_array_now<T>)
      .def("grouped_allreduce_arrays", &grouped_allreduce_arrays<T>)
      .def("grouped_allreduce",
           [](T& eng, std::vector<py::handle> ins, std::vector<py::handle> outs,
              std::vector<std::vector<int64_t>> shapes, std::vector<int32_t> dtypes,
              std::vector<std::string> names, int32_t op, double pre, double post,
              std::string group) {
             std::vector<Entry> es;
             for (size_t i = 0; i < ins.size(); ++i) {
               es.push_back(entry(CollKind::kAllreduce, ins[i], outs.at(i), shapes.at(i),
                                  dtypes.at(i), names.at(i)));
               reducing(es.back(), op, pre, post).meta.group = group;
             }
             return submit_all(eng, std::move(es));
           })
      .def("allgather",
           [](T& eng, py::handle in, std::vector<int64_t> shape, int32_t dtype, std::string name) {
             return submit_one(eng, entry(CollKind::kAllgather, in, py::none(), std::move(shape),
                                          dtype, std::move(name)));
           })
      .def("broadcast",
           [](T& eng, py::handle buf, std::vector<int64_t> shape, int32_t dtype, int root,
              std::string name) {
             Entry e =
                 entry(CollKind::kBroadcast, buf, buf, std::move(shape), dtype, std::move(name));
             e.meta.root = root;
             return submit_one(eng, std::move(e));
           })
      .def("reducescatter",
           [](T& eng, py::handle in, std::vector<int64_t> shape, int32_t dtype, int32_t op,
              double pre, double post, std::string name) {
             Entry e = entry(CollKind::kReducescatter, in, py::none(), std::move(shape), dtype,
                             std::move(name));
             return submit_one(eng, std::move(reducing(e, op, pre, post)));
           })
      .def("alltoall",
           [](T& eng, py::handle in, std::vector<int64_t> shape, int32_t dtype,
              std::vector<int64_t> splits, std::string name) {
             Entry e = entry(CollKind::kAlltoall, in, py::none(), std::move(shape), dtype,
                             std::move(name));
             e.splits = std::move(splits);
             return submit_one(eng, std::move(e));
           })
      .def("barrier", [](T& eng, std::string name) {
        Entry e;
        e.meta.kind = CollKind::kBarrier;
        e.meta.dtype = DType::kUInt8;
        e.meta.name = std::move(name);
        return submit_one(eng, std::move(e));
      });
}

void bind_engine_class(py::module_& m) {
  py::class_<Engine, std::shared_ptr<Engine>> engine(m, "Engine");
  engine.def(py::init([](std::shared_ptr<Context> ctx) {
    return std::make_shared<Engine>(std::move(ctx), engine_options_from_env());
  }));
  def_collectives(engine);
  engine
      .def("process_set",
           [](std::shared_ptr<Engine> eng, std::vector<int32_t> members) {
             return std::make_shared<SetEngine>(SetEngine{std::move(eng), std::move(members)});
           })
      .def("stats",
           [](const Engine& eng) {
             const EngineStats s = eng.stats();
             py::dict d;
             d["rounds"] = s.rounds;
             d["responses"] = s.responses;
             d["tensors"] = s.tensors;
             d["shared_allreduces"] = s.shared_allreduces;
             d["hierarchical_allreduces"] = s.hierarchical_allreduces;
             d["hierarchical_allgathers"] = s.hierarchical_allgathers;
             d["adasum_allreduces"] = s.adasum_allreduces;
             d["caller_rounds"] = s.caller_rounds;
             d["folded"] = s.folded;
             d["paired"] = s.paired;
             d["device_holds"] = s.device_holds;
             d["gpu_device"] = s.gpu_device;
             d["autotuning"] = s.autotuning;
             d["autotune_trials"] = s.autotune_trials;
             d["fusion_threshold"] = s.fusion_threshold;
             d["cycle_time_ms"] = s.cycle_time_ms;
             d["batch_us"] = s.batch_us;
             d["hierarchical"] = s.hierarchical;
             return d;
           })
      .def("create_shared",
           [](Engine& eng, size_t bytes) -> py::object {
             std::shared_ptr<SharedRegion> r;
             {
               py::gil_scoped_release nogil;  // waits for the other ranks
               r = eng.create_shared(bytes);
             }
             return r ? py::cast(r) : py::none();
           })
      .def("reject", [](Engine& eng, const std::string& kind, const std::string& name,
                        const std::string& why) { reject_call(eng, {}, kind, name, why); })
      .def(
          "join", [](Engine& eng, int32_t gpu_device) { return eng.join({}, gpu_device); },
          py::arg("gpu_device") = -1, py::call_guard<py::gil_scoped_release>())
      .def("join_epoch", &Engine::join_epoch)
      .def("start_timeline", &Engine::start_timeline, py::arg("path"),
           py::arg("mark_cycles") = false, py::call_guard<py::gil_scoped_release>())
      .def("stop_timeline", &Engine::stop_timeline, py::call_guard<py::gil_scoped_release>())
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>());
  py::class_<SetEngine, std::shared_ptr<SetEngine>> set(m, "ProcessSetEngine");
  def_collectives(set);
  set.def_readonly("members", &SetEngine::members)
      .def("stats", [](SetEngine& s) { return py::cast(s.eng).attr("stats")(); })
      .def(
          "join",
          [](SetEngine& s, int32_t gpu_device) { return s.eng->join(s.members, gpu_device); },
          py::arg("gpu_device") = -1, py::call_guard<py::gil_scoped_release>())
      .def("join_epoch", [](SetEngine& s) { return s.eng->join_epoch(); })
      .def("reject",
           [](SetEngine& s, const std::string& kind, const std::string& name,
              const std::string& why) { reject_call(*s.eng, s.members, kind, name, why); });
}

}  // namespace

void bind_engine(py::module_& m) {
  bind_handle(m);
  bind_shared_buffer(m);
  bind_engine_class(m);
}

}  // namespace rr
