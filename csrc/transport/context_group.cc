// Group views of a Context: a subset of the job's ranks seen as a job of its
// own, over the links the job already has. A view owns no link, segment or
// socket; rank(), size() and link() are translated through the member list,
// failures are reported to (and checked on) the parent, and views of views
// translate twice. Views are made lazily and kept until the parent closes.
#include <algorithm>

#include "common/error.h"
#include "transport/context.h"

namespace rr {

static ContextOptions view_options(const ContextOptions& parent, int rank_in_group, int size) {
  ContextOptions o = parent;
  o.rank = rank_in_group;
  o.size = size;
  return o;
}

static int position_of(const std::vector<int>& members, int rank) {
  auto it = std::find(members.begin(), members.end(), rank);
  return it == members.end() ? -1 : static_cast<int>(it - members.begin());
}

Context::Context(Context& parent, std::vector<int> members)
    : opt_(view_options(parent.opt_, position_of(members, parent.rank()),
                        static_cast<int>(members.size()))),
      progress_(parent.progress_),
      allowed_(parent.allowed_),
      stream_choice_(parent.opt_.shm_stream_mode),
      parent_(&parent),
      members_(std::move(members)) {
  connected_ = true;
}

Context& Context::group(const std::vector<int>& members) {
  auto found = groups_.find(members);
  if (found != groups_.end()) return *found->second;
  std::vector<int> sorted = members;
  std::sort(sorted.begin(), sorted.end());
  const bool distinct = std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
  const bool in_range = !sorted.empty() && sorted.front() >= 0 && sorted.back() < opt_.size;
  if (!distinct || !in_range || position_of(members, opt_.rank) < 0)
    throw_error(ErrorKind::kInvalidArgument, "rank ", global_rank(opt_.rank),
                ": a group must list distinct ranks of [0, ", opt_.size,
                ") including this rank; got ", members.size(), " ranks");
  std::unique_ptr<Context> view(new Context(*this, members));
  Context& ref = *view;
  groups_.emplace(members, std::move(view));
  return ref;
}

}  // namespace rr
