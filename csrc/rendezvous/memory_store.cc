#include "rendezvous/memory_store.h"

namespace rr {

void InMemoryStore::set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    data_[key] = value;
  }
  // All waiters wake because they may wait on different keys; stores are tiny
  // and sets are rare, so the thundering herd costs nothing.
  changed_.notify_all();
}

std::string InMemoryStore::add(const std::string& key, const std::string& value) {
  std::string now;
  {
    std::lock_guard<std::mutex> lock(mu_);
    now = data_.emplace(key, value).first->second;
  }
  changed_.notify_all();
  return now;
}

std::string InMemoryStore::get(const std::string& key, double timeout_s) {
  const auto deadline = deadline_after(timeout_s);
  std::unique_lock<std::mutex> lock(mu_);
  auto present = [&] { return data_.count(key) != 0; };
  if (!changed_.wait_until(lock, deadline, present)) {
    throw_error(ErrorKind::kTimeout, "in-memory store: key '", key, "' did not appear within ",
                timeout_s, "s");
  }
  return data_.at(key);
}

}  // namespace rr
