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

Timeline::Timeline(const std::string& path) : start_(std::chrono::steady_clock::now()) {
  file_ = std::fopen(path.c_str(), "w");
  if (!file_)
    throw_error(ErrorKind::kInvalidArgument, "RINGREDUCE_TIMELINE: cannot write '", path,
                "': ", errno_string(errno));
  std::fputs(
      "[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"args\":{\"name\":"
      "\"ringreduce\"}}",
      file_);
}

Timeline::~Timeline() {
  close();
}

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
  buf_ += ph[0] == 'i' ? ",\"s\":\"t\"}" : "}";
}

void Timeline::negotiate_begin(const std::string& tensor, const char* op) {
  std::string name = cat("NEGOTIATE_", op);
  for (auto& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  event("B", row(tensor), name);
}

void Timeline::rank_ready(const std::string& tensor, int rank) {
  event("i", row(tensor), cat("rank ", rank, " ready"));
}

void Timeline::negotiate_end(const std::string& tensor) {
  int tid = row(tensor);
  event("E", tid, "");
  event("B", tid, "WAIT");
}

void Timeline::begin(const std::string& tensor, const std::string& activity) {
  event("B", row(tensor), activity);
}

void Timeline::end(const std::string& tensor) {
  event("E", row(tensor), "");
}

void Timeline::set_current(const std::vector<std::string>& tensors) {
  phase_end();
  current_ = tensors;
}

void Timeline::phase(const char* name) {
  phase_end();
  for (const auto& t : current_) begin(t, name);
  in_phase_ = true;
}

void Timeline::phase_end() {
  if (!in_phase_) return;
  for (const auto& t : current_) end(t);
  in_phase_ = false;
}

void Timeline::flush() {
  if (!file_ || buf_.empty()) return;
  std::fwrite(buf_.data(), 1, buf_.size(), file_);
  std::fflush(file_);
  buf_.clear();
}

void Timeline::close() {
  if (!file_) return;
  phase_end();
  flush();
  std::fputs("\n]\n", file_);
  std::fclose(file_);
  file_ = nullptr;
}

}  // namespace rr
