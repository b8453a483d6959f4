// The target's open streams, as the service sees them: each registered from
// its start until it is done, admitted against --max_streams and its
// client's share at its Open, and reached through RegisteredStream for the
// drain, the idle and Open deadlines and /metrics. It knows streams only by
// that interface, so a stream can hold the registry without the registry
// holding the stream's header.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/service/log_rate_limit.h"

namespace draftfeed {

// One open stream's share of the target at a scrape.
struct StreamLoad {
  uint64_t id = 0;  // the stream's queue in the scheduler
  std::string client_name;
  int32_t credits = 0;        // batches it may have in flight (0 before its Opened)
  int64_t inflight = 0;       // credits in use: batches whose last message is not written
  int64_t pending_bytes = 0;  // result bytes taken for the forward and not yet written
  int64_t reject_pauses = 0;  // times its reads paused for refusing too many batches a second
};

// What the service asks of a stream (StreamReactor says what each does).
class RegisteredStream {
 public:
  virtual ~RegisteredStream() = default;
  virtual void Drain() = 0;
  virtual bool EndIfIdle(std::chrono::steady_clock::time_point now,
                         std::chrono::steady_clock::duration timeout) = 0;
  virtual void EndIfNotOpened(std::chrono::steady_clock::time_point now,
                              std::chrono::steady_clock::duration timeout) = 0;
  virtual void ResumeIfThrottled(std::chrono::steady_clock::time_point now) = 0;
  virtual void Cancel() = 0;
  virtual StreamLoad Load() = 0;
};

class StreamRegistry {
 public:
  // The limits Admit holds streams to (0: none).
  StreamRegistry(int32_t max_streams, int32_t max_streams_per_client)
      : max_streams_(max_streams), max_streams_per_client_(max_streams_per_client) {}

  // Every stream is registered from its start until it is done (its last
  // callback), when Unregister also uncounts it if it was admitted.
  void Register(RegisteredStream* s);
  void Unregister(RegisteredStream* s);
  // At a stream's Open: counts it as open, or RESOURCE_EXHAUSTED naming
  // --max_streams (that many are open) or --max_streams_per_client (its
  // client, `client`, holds its share).
  absl::Status Admit(RegisteredStream* s, const std::string& client);
  int64_t open_streams() const;

  // Calls `fn` for each registered stream, under the registry's lock, which
  // keeps every one of them alive (a stream unregisters before it is
  // deleted). `fn` may take the stream's lock (the order everywhere: the
  // registry's, then the stream's) but not call the registry.
  void ForEach(const std::function<void(RegisteredStream*)>& fn) const;
  // Each registered stream's credits and waiting result bytes, now.
  std::vector<StreamLoad> Loads() const;

  // The most responses one stream has held queued and not yet written, over
  // the target's life: what a stream's memory holds beyond its payloads.
  void NoteQueuedResponses(int64_t queued);
  int64_t peak_queued_responses() const { return peak_queued_responses_.load(); }

  // Writes a refused stream's log line, at most kRefusalLinesPerS a second;
  // the next line written after some were held back says how many.
  void LogRefusedStream(const std::string& line);
  static constexpr int64_t kRefusalLinesPerS = 10;

 private:
  const int32_t max_streams_;
  const int32_t max_streams_per_client_;
  mutable std::mutex mu_;
  std::set<RegisteredStream*> streams_;
  // The open (admitted) streams, by client. Its own lock: Admit runs under a
  // stream's lock, which ForEach's callers take under mu_.
  mutable std::mutex admit_mu_;
  std::map<RegisteredStream*, std::string> admitted_;
  std::map<std::string, int32_t> client_streams_;
  std::atomic<int64_t> peak_queued_responses_{0};
  LogRateLimit refusal_log_{kRefusalLinesPerS};
};

}  // namespace draftfeed
