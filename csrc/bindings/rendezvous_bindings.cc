#include "bindings/rendezvous_bindings.h"

#include <memory>
#include <string>
#include <vector>

#include "common/sha256.h"
#include "rendezvous/memory_store.h"
#include "rendezvous/store.h"
#include "rendezvous/tcp_store.h"

namespace py = pybind11;

namespace rr {

namespace {

// Values cross the boundary as bytes, never str: rendezvous payloads are
// binary (packed addresses, MACs) and must not be re-encoded.
std::string bytes_arg(const py::bytes& b) {
  return static_cast<std::string>(b);
}

void bind_stores(py::module_& m) {
  // shared_ptr holders let C++ code that joins a job keep the store alive
  // independently of the Python object.
  py::class_<Store, std::shared_ptr<Store>>(
      m, "Store", "Key-value store used for rendezvous. Abstract: use a subclass.")
      .def(
          "set",
          [](Store& s, const std::string& key, const py::bytes& value) {
            std::string v = bytes_arg(value);
            py::gil_scoped_release nogil;
            s.set(key, v);
          },
          py::arg("key"), py::arg("value"), "Publish value under key, replacing any old value.")
      .def(
          "get",
          [](Store& s, const std::string& key, double timeout) {
            std::string v;
            {
              py::gil_scoped_release nogil;
              v = s.get(key, timeout);
            }
            return py::bytes(v);
          },
          py::arg("key"), py::arg("timeout"),
          "Block until key exists and return its value; raise on timeout (seconds).")
      .def(
          "add",
          [](Store& s, const std::string& key, const py::bytes& value) {
            std::string v = bytes_arg(value), now;
            {
              py::gil_scoped_release nogil;
              now = s.add(key, v);
            }
            return py::bytes(now);
          },
          py::arg("key"), py::arg("value"),
          "Publish value under key unless it exists; return what the key holds now.")
      .def(
          "allgather",
          [](Store& s, const std::string& prefix, int rank, int size, const py::bytes& value,
             double timeout) {
            std::string mine = bytes_arg(value);
            std::vector<std::string> all;
            {
              py::gil_scoped_release nogil;
              all = store_allgather(s, prefix, rank, size, mine, timeout);
            }
            py::list out;
            for (const auto& v : all) out.append(py::bytes(v));
            return out;
          },
          py::arg("prefix"), py::arg("rank"), py::arg("size"), py::arg("value"), py::arg("timeout"),
          "Publish value as <prefix>/<rank> and return every rank's value, indexed by rank. "
          "Use each prefix for one allgather only.");

  py::class_<TcpStoreClient, Store, std::shared_ptr<TcpStoreClient>>(
      m, "TcpStoreClient", "Client of a TcpStoreServer; connects with retry for up to timeout s.")
      .def(py::init([](const std::string& host, int port, double timeout) {
             py::gil_scoped_release nogil;
             return std::make_shared<TcpStoreClient>(host, port, timeout);
           }),
           py::arg("host"), py::arg("port"), py::arg("timeout"));

  py::class_<InMemoryStore, Store, std::shared_ptr<InMemoryStore>>(
      m, "InMemoryStore", "Store shared by ranks running as threads of one process.")
      .def(py::init<>());
}

void bind_server(py::module_& m) {
  py::class_<TcpStoreServer>(m, "TcpStoreServer",
                             "Serves a store from a background thread. port=0 picks a free port.")
      .def(py::init<const std::string&, int>(), py::arg("host"), py::arg("port"))
      .def_property_readonly("port", &TcpStoreServer::port)
      .def("close", &TcpStoreServer::close, py::call_guard<py::gil_scoped_release>(),
           "Stop serving and drop every client connection. Idempotent.")
      .def(
          "__enter__", [](TcpStoreServer& s) -> TcpStoreServer& { return s; },
          py::return_value_policy::reference_internal)
      .def("__exit__", [](TcpStoreServer& s, const py::args&) {
        py::gil_scoped_release nogil;
        s.close();
      });
}

}  // namespace

void bind_rendezvous(py::module_& m) {
  bind_stores(m);
  bind_server(m);
  m.def(
      "hmac_sha256",
      [](const py::bytes& key, const py::bytes& msg) {
        const std::string k = bytes_arg(key);
        const std::string v = bytes_arg(msg);
        auto mac = hmac_sha256(k, v.data(), v.size());
        return py::bytes(reinterpret_cast<const char*>(mac.data()), mac.size());
      },
      py::arg("key"), py::arg("msg"), "HMAC-SHA-256 of msg under key (32 bytes).");
}

}  // namespace rr
