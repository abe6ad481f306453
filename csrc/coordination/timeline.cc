#include "coordination/timeline.h"

#include "common/error.h"

namespace rr {

namespace {

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char tmp[8];
      std::snprintf(tmp, sizeof tmp, "\\u%04x", c);
      out += tmp;
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

void Timeline::start(const std::string& path, bool mark_cycles) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f)
    throw_error(ErrorKind::kInvalidArgument, "timeline: cannot write '", path,
                "': ", errno_string(errno));
  std::lock_guard<std::mutex> lock(mutex_);
  stop_locked();
  file_ = f;
  rows_.clear();
  current_.clear();
  mark_cycles_ = mark_cycles;
  start_ = std::chrono::steady_clock::now();
  std::fputs(
      "[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"args\":{\"name\":"
      "\"ringreduce\"}}",
      file_);
  active_ = true;
}

void Timeline::stop() {
  std::lock_guard<std::mutex> lock(mutex_);
  stop_locked();
}

Timeline::~Timeline() {
  stop();
}

// Callers hold mutex_ and have checked file_.
int Timeline::row(const std::string& tensor) {
  auto it = rows_.find(tensor);
  if (it != rows_.end()) return it->second;
  int tid = static_cast<int>(rows_.size()) + 1;
  rows_.emplace(tensor, tid);
  buf_ += cat(",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":", tid,
              ",\"args\":{\"name\":\"", json_escape(tensor), "\"}}");
  return tid;
}

void Timeline::event(const char* ph, int tid, const std::string& name) {
  auto us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start_);
  buf_ += cat(",\n{\"name\":\"", json_escape(name), "\",\"ph\":\"", ph,
              "\",\"pid\":0,\"tid\":", tid, ",\"ts\":", static_cast<int64_t>(us.count()));
  buf_ += ph[0] == 'i' ? (tid == 0 ? ",\"s\":\"g\"}" : ",\"s\":\"t\"}") : "}";
}

void Timeline::cycle_start() {
  if (!active()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (file_ && mark_cycles_) event("i", 0, "CYCLE_START");  // global: a line across all rows
}

void Timeline::negotiate_begin(const std::string& tensor, const char* op) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!file_) return;
  std::string name = cat("NEGOTIATE_", op);
  for (auto& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  event("B", row(tensor), name);
}

void Timeline::rank_ready(const std::string& tensor, int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!file_) return;
  event("i", row(tensor), cat("rank ", rank, " ready"));
}

void Timeline::negotiate_end(const std::string& tensor) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!file_) return;
  int tid = row(tensor);
  event("E", tid, "");
  event("B", tid, "WAIT");
}

void Timeline::begin(const std::string& tensor, const std::string& activity) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!file_) return;
  event("B", row(tensor), activity);
}

void Timeline::end(const std::string& tensor) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!file_) return;
  event("E", row(tensor), "");
}

void Timeline::set_current(const std::vector<std::string>& tensors) {
  if (!active()) return;  // no trace open: no lock on the collectives' path
  std::lock_guard<std::mutex> lock(mutex_);
  if (!file_) return;
  phase_end_locked();
  current_ = tensors;
}

void Timeline::phase(const char* name) {
  if (!active()) return;  // no trace open: no lock on the collectives' path
  std::lock_guard<std::mutex> lock(mutex_);
  if (!file_) return;
  phase_end_locked();
  for (const auto& t : current_) event("B", row(t), name);
  in_phase_ = true;
}

void Timeline::phase_end() {
  if (!active()) return;  // no trace open: no lock on the collectives' path
  std::lock_guard<std::mutex> lock(mutex_);
  phase_end_locked();
}

void Timeline::phase_end_locked() {
  if (!in_phase_ || !file_) return;
  for (const auto& t : current_) event("E", row(t), "");
  in_phase_ = false;
}

void Timeline::flush() {
  std::lock_guard<std::mutex> lock(mutex_);
  flush_locked();
}

void Timeline::flush_locked() {
  if (!file_ || buf_.empty()) return;
  std::fwrite(buf_.data(), 1, buf_.size(), file_);
  std::fflush(file_);
  buf_.clear();
}

void Timeline::stop_locked() {
  if (!file_) return;
  phase_end_locked();
  flush_locked();
  std::fputs("\n]\n", file_);
  std::fclose(file_);
  file_ = nullptr;
  in_phase_ = false;
  active_ = false;
}

}  // namespace rr
