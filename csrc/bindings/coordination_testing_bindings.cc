// Unit-test access to the coordination layer's pure logic (submodule
// ringreduce._core.coordination): tensors and responses cross as dicts.
#include <pybind11/stl.h>

#include "bindings/engine_bindings.h"
#include "coordination/autotuner.h"
#include "coordination/bayes_opt.h"
#include "coordination/fusion.h"
#include "coordination/negotiator.h"
#include "coordination/response_cache.h"

namespace py = pybind11;

namespace rr {
namespace {

CollKind kind_from(const std::string& s) {
  for (CollKind k : {CollKind::kAllreduce, CollKind::kAllgather, CollKind::kBroadcast,
                     CollKind::kReducescatter, CollKind::kAlltoall, CollKind::kBarrier})
    if (s == coll_name(k)) return k;
  throw_error(ErrorKind::kInvalidArgument, "unknown collective '", s, "'");
}

}  // namespace

RequestMeta request_meta_from(const py::dict& d) {
  RequestMeta m;
  m.name = d["name"].cast<std::string>();
  m.kind = kind_from(d.contains("kind") ? d["kind"].cast<std::string>() : "allreduce");
  m.dtype = static_cast<DType>(d.contains("dtype") ? d["dtype"].cast<int>() : 6);
  m.op = static_cast<ReduceOp>(d.contains("op") ? d["op"].cast<int>() : 0);
  m.root = d.contains("root") ? d["root"].cast<int>() : -1;
  m.shape = d.contains("shape") ? d["shape"].cast<std::vector<int64_t>>() : std::vector<int64_t>{1};
  m.prescale = d.contains("prescale") ? d["prescale"].cast<double>() : 1.0;
  m.postscale = d.contains("postscale") ? d["postscale"].cast<double>() : 1.0;
  m.group = d.contains("group") ? d["group"].cast<std::string>() : "";
  m.device = d.contains("device") ? d["device"].cast<int32_t>() : -1;
  if (d.contains("members")) m.members = d["members"].cast<std::vector<int32_t>>();
  m.wire = d.contains("wire") ? d["wire"].cast<int32_t>() : -1;
  return m;
}

namespace {

py::dict response_dict(const Response& r) {
  py::dict d;
  d["type"] = resp_type_name(r.type);
  std::vector<std::string> names;
  for (const auto& t : r.tensors) names.push_back(t.name);
  d["tensors"] = names;
  d["contributors"] = r.contributors;
  d["last_joined"] = r.last_joined;
  d["message"] = r.message;
  return d;
}

std::vector<py::dict> response_dicts(const std::vector<Response>& rs) {
  std::vector<py::dict> out;
  for (const auto& r : rs) out.push_back(response_dict(r));
  return out;
}

py::dict tunables_dict(const Tunables& t) {
  py::dict d;
  d["fusion_mb"] = t.fusion_mb;
  d["cycle_ms"] = t.cycle_ms;
  d["batch_us"] = t.batch_us;
  d["hierarchical"] = t.hierarchical;
  d["active"] = t.active;
  d["trials"] = t.trials;
  return d;
}

Tunables tunables_from(const py::dict& d) {
  Tunables t;
  for (auto [key, field] : {std::pair<const char*, double*>{"fusion_mb", &t.fusion_mb},
                            {"cycle_ms", &t.cycle_ms},
                            {"batch_us", &t.batch_us},
                            {"hierarchical", &t.hierarchical},
                            {"active", &t.active},
                            {"trials", &t.trials}})
    if (d.contains(key)) *field = d[key].cast<double>();
  return t;
}

// Options as autotune_options_from_env() makes them, overridden by `d`.
AutotuneOptions autotune_options_from(const py::dict& d) {
  AutotuneOptions o;
  o.enabled = true;
  if (d.contains("log_path")) o.log_path = d["log_path"].cast<std::string>();
  if (d.contains("warmup_samples")) o.warmup_samples = d["warmup_samples"].cast<int>();
  if (d.contains("steps_per_sample")) o.steps_per_sample = d["steps_per_sample"].cast<int>();
  if (d.contains("bayes_opt_max_samples"))
    o.bayes_opt_max_samples = d["bayes_opt_max_samples"].cast<int>();
  if (d.contains("gp_noise")) o.gp_noise = d["gp_noise"].cast<double>();
  o.fixed_fusion = d.contains("fixed_fusion") && d["fixed_fusion"].cast<bool>();
  o.fixed_cycle = d.contains("fixed_cycle") && d["fixed_cycle"].cast<bool>();
  o.fixed_batch = d.contains("fixed_batch") && d["fixed_batch"].cast<bool>();
  if (d.contains("batch_hi_us")) o.batch_hi_us = d["batch_hi_us"].cast<double>();
  return o;
}

void bind_autotune_testing(py::module_& m) {
  py::class_<BayesOpt>(m, "BayesOpt")
      .def(py::init<int, double, uint64_t>(), py::arg("dims"), py::arg("noise"),
           py::arg("seed") = 0x5eed)
      .def("add", &BayesOpt::add)
      .def("next", &BayesOpt::next)
      .def("predict", &BayesOpt::predict)
      .def_property_readonly("samples", &BayesOpt::samples);
  py::class_<Autotuner>(m, "Autotuner")
      .def(
          py::init([](const py::dict& options, const py::dict& start, bool hierarchical, int rank) {
            return std::make_unique<Autotuner>(autotune_options_from(options), tunables_from(start),
                                               hierarchical, rank);
          }),
          py::arg("options"), py::arg("start"), py::arg("hierarchical") = false,
          py::arg("rank") = 0)
      .def("observe",
           [](Autotuner& a, const std::vector<py::dict>& tensors, double now) {
             std::vector<RequestMeta> ms;
             for (const auto& d : tensors) ms.push_back(request_meta_from(d));
             return a.observe(ms, now);
           })
      .def("decide", [](Autotuner& a) { return tunables_dict(a.decide()); })
      .def("adopt",
           [](Autotuner& a, const py::dict& d, double now) { a.adopt(tunables_from(d), now); })
      .def_property_readonly("current",
                             [](const Autotuner& a) { return tunables_dict(a.current()); });
}

}  // namespace

void bind_coordination_testing(py::module_& parent) {
  py::module_ m = parent.def_submodule("coordination", "unit-test access to negotiation logic");
  py::class_<Negotiator>(m, "Negotiator")
      .def(py::init([](int size, uint64_t fusion, double stall_check, double stall_shutdown) {
             return std::make_unique<Negotiator>(
                 NegotiatorOptions{size, fusion, stall_check, stall_shutdown});
           }),
           py::arg("size"), py::arg("fusion_threshold") = 64 << 20, py::arg("stall_check") = 60.0,
           py::arg("stall_shutdown") = 0.0)
      .def("submit", [](Negotiator& n, int rank, const py::dict& meta,
                        double now) { n.submit(rank, request_meta_from(meta), now); })
      .def("join", &Negotiator::join, py::arg("rank"), py::arg("now") = 0.0,
           py::arg("members") = std::vector<int32_t>{})
      .def("decide", [](Negotiator& n, double now) { return response_dicts(n.decide(now)); })
      .def("next_deadline", &Negotiator::next_deadline)
      .def("set_fusion_threshold", &Negotiator::set_fusion_threshold)
      .def_property_readonly("pending", &Negotiator::pending);
  m.def("plan_fusion", [](const std::vector<py::dict>& tensors, uint64_t threshold) {
    std::vector<Response> ready;
    for (const auto& d : tensors) {
      Response r;
      r.tensors.push_back(request_meta_from(d));
      r.contributors = d.contains("contributors") ? d["contributors"].cast<int>() : 2;
      ready.push_back(r);
    }
    return response_dicts(plan_fusion(std::move(ready), threshold));
  });
  py::class_<ResponseCache>(m, "ResponseCache")
      .def(py::init<size_t>())
      .def("put", [](ResponseCache& c, const py::dict& d) { c.put(request_meta_from(d)); })
      .def("lookup",
           [](const ResponseCache& c, const py::dict& d) { return c.lookup(request_meta_from(d)); })
      .def("lru_order", &ResponseCache::lru_order)
      .def_property_readonly("slots", &ResponseCache::slots);
  bind_autotune_testing(m);
}

}  // namespace rr
