#include "server/service/stream_registry.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/log_line.h"

namespace draftfeed {

void StreamRegistry::Register(RegisteredStream* s) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.insert(s);
}

absl::Status StreamRegistry::Admit(RegisteredStream* s, const std::string& client) {
  std::lock_guard<std::mutex> lock(admit_mu_);
  if (max_streams_ > 0 && static_cast<int64_t>(admitted_.size()) >= max_streams_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("this target serves at most --max_streams=", max_streams_,
                     " streams at once and all are open; retry later or use another target"));
  }
  int32_t& mine = client_streams_[client];
  if (max_streams_per_client_ > 0 && mine >= max_streams_per_client_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this target serves at most --max_streams_per_client=", max_streams_per_client_,
        " streams of one client at once and ", client, " has that many open; close one first"));
  }
  ++mine;
  admitted_.emplace(s, client);
  return absl::OkStatus();
}

void StreamRegistry::Unregister(RegisteredStream* s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    streams_.erase(s);
  }
  std::lock_guard<std::mutex> lock(admit_mu_);
  if (auto it = admitted_.find(s); it != admitted_.end()) {
    if (--client_streams_[it->second] <= 0) client_streams_.erase(it->second);
    admitted_.erase(it);
  }
}

int64_t StreamRegistry::open_streams() const {
  std::lock_guard<std::mutex> lock(admit_mu_);
  return static_cast<int64_t>(admitted_.size());
}

void StreamRegistry::ForEach(const std::function<void(RegisteredStream*)>& fn) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (RegisteredStream* s : streams_) fn(s);
}

std::vector<StreamLoad> StreamRegistry::Loads() const {
  std::vector<StreamLoad> out;
  ForEach([&out](RegisteredStream* s) { out.push_back(s->Load()); });
  return out;
}

void StreamRegistry::NoteQueuedResponses(int64_t queued) {
  int64_t peak = peak_queued_responses_.load(std::memory_order_relaxed);
  while (queued > peak && !peak_queued_responses_.compare_exchange_weak(peak, queued)) {
  }
}

void StreamRegistry::LogRefusedStream(const std::string& line) {
  int64_t suppressed = 0;
  if (!refusal_log_.Allow(std::chrono::steady_clock::now(), &suppressed)) return;
  if (suppressed > 0) {
    LogF("draftfeed-target: %lld more stream refusals suppressed (at most %lld lines a second)",
         static_cast<long long>(suppressed), static_cast<long long>(kRefusalLinesPerS));
  }
  std::fprintf(stderr, "%s\n", line.c_str());
}

}  // namespace draftfeed
