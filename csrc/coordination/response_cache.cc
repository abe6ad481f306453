#include "coordination/response_cache.h"

#include "common/error.h"

namespace rr {

int64_t ResponseCache::lookup(const RequestMeta& m) const {
  auto it = by_name_.find(m.name);
  if (it == by_name_.end() || entries_[it->second] != m) return -1;
  return it->second;
}

const RequestMeta& ResponseCache::at(uint32_t id) const {
  RR_CHECK(id < entries_.size() && valid_[id], "response cache id ", id,
           " is not in use (caches out of step between ranks)");
  return entries_[id];
}

void ResponseCache::put(const RequestMeta& m) {
  if (capacity_ == 0) return;
  auto it = by_name_.find(m.name);
  if (it != by_name_.end()) {
    uint32_t id = it->second;
    entries_[id] = m;  // same name with new metadata replaces the old entry
    lru_.splice(lru_.end(), lru_, pos_[id]);
    return;
  }
  uint32_t id;
  if (entries_.size() < capacity_) {
    id = static_cast<uint32_t>(entries_.size());
    entries_.emplace_back();
    valid_.push_back(false);
    pos_.emplace_back();
  } else {
    id = lru_.front();
    lru_.pop_front();
    by_name_.erase(entries_[id].name);
  }
  entries_[id] = m;
  valid_[id] = true;
  by_name_[m.name] = id;
  pos_[id] = lru_.insert(lru_.end(), id);
}

}  // namespace rr
