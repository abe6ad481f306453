// The response cache: once a tensor has run, every rank remembers its
// metadata under a small integer id. When the same tensor comes again (the
// next training step), a rank announces it with one bit instead of its full
// request, and the coordinator answers with the id instead of the metadata.
//
// Invariant: all ranks hold identical caches. Entries change only while a
// response list is processed, which every rank does with the same list in
// the same order; eviction is least-recently-used, so ids agree too.
#pragma once

#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <vector>

#include "coordination/request.h"

namespace rr {

class ResponseCache {
 public:
  explicit ResponseCache(size_t capacity) : capacity_(capacity) {}

  // Number of ids in use (bit vectors cover ids [0, slots())).
  size_t slots() const { return entries_.size(); }
  // Id of a cached entry with exactly this metadata, or -1.
  int64_t lookup(const RequestMeta& m) const;
  // Throws kInternal for an id that holds nothing (caches out of step).
  const RequestMeta& at(uint32_t id) const;
  // Records that `m` ran: inserts it (evicting the least recently used entry
  // when full, or the stale entry of the same name) or marks it used.
  void put(const RequestMeta& m);
  // Ids from least to most recently used (for tests).
  std::vector<uint32_t> lru_order() const { return {lru_.begin(), lru_.end()}; }

 private:
  size_t capacity_;
  std::vector<RequestMeta> entries_;
  std::vector<bool> valid_;
  std::vector<std::list<uint32_t>::iterator> pos_;
  std::list<uint32_t> lru_;  // front = least recently used
  std::unordered_map<std::string, uint32_t> by_name_;
};

}  // namespace rr
