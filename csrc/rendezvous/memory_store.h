// A Store shared by ranks that are threads of one process: tests and
// single-node simulations run N ranks without any sockets.
#pragma once

#include <condition_variable>
#include <map>
#include <mutex>
#include <string>

#include "rendezvous/store.h"

namespace rr {

// Thread-safe; every rank thread holds a reference to the same instance.
class InMemoryStore : public Store {
 public:
  InMemoryStore() = default;
  InMemoryStore(const InMemoryStore&) = delete;
  InMemoryStore& operator=(const InMemoryStore&) = delete;

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, double timeout_s) override;
  std::string add(const std::string& key, const std::string& value) override;

 private:
  std::mutex mu_;
  std::condition_variable changed_;  // notified on every set
  std::map<std::string, std::string> data_;
};

}  // namespace rr
