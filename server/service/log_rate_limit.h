// A cap on how many lines of one kind a second reach the log: a client that
// opens streams only to have them refused (6,000 of them wrote 1.38 MB in
// 4 s) must not fill the disk or drown the lines that matter.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>

namespace draftfeed {

class LogRateLimit {
 public:
  explicit LogRateLimit(int64_t per_second) : per_second_(per_second) {}

  // Whether a line may be written at `now`: at most per_second in each
  // second. A line held back is counted; the next one let through gets that
  // count in `*suppressed` (0 when none), to say so in one line.
  bool Allow(std::chrono::steady_clock::time_point now, int64_t* suppressed) {
    std::lock_guard<std::mutex> lock(mu_);
    if (now - window_ >= std::chrono::seconds(1)) {
      window_ = now;
      in_window_ = 0;
    }
    if (in_window_ >= per_second_) {
      ++suppressed_;
      return false;
    }
    ++in_window_;
    *suppressed = suppressed_;
    suppressed_ = 0;
    return true;
  }

 private:
  const int64_t per_second_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point window_{};
  int64_t in_window_ = 0;
  int64_t suppressed_ = 0;
};

}  // namespace draftfeed
