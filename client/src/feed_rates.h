// The rates in FeedStats and TargetStats: since a start, and over a recent
// window (FeedOptions::stats_window_s) from samples of the counters' running
// totals. Times are seconds since the feed opened, passed in rather than read
// from a clock, so the arithmetic is tested with chosen times instead of
// waits. The Python client's stats() reads these numbers; it keeps no window
// of its own.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>

#include "draftfeed/client.h"

namespace draftfeed {

// Rates of N cumulative counters over the last `window_s` seconds. A sample
// is kept at most every window_s / kSamplesPerWindow seconds, so recording at
// every batch costs O(1) memory however fast batches come. The base of the
// rates is the newest sample at or before the window's start (or the oldest,
// early on): a rate spans window_s plus at most one sample spacing once the
// window is full, and less before.
template <size_t N>
class RateWindow {
 public:
  using Counts = std::array<int64_t, N>;
  static constexpr int kSamplesPerWindow = 64;

  struct Rates {
    std::array<double, N> per_s{};  // increase per second of each counter
    double span_s = 0;              // seconds from the base sample to now
  };

  // `window_s` > 0 (Feed::Open checks FeedOptions::stats_window_s); the
  // counters are `zero` at `start_s`.
  explicit RateWindow(double window_s = 30.0, double start_s = 0, const Counts& zero = {})
      : window_s_(window_s), spacing_s_(window_s / kSamplesPerWindow) {
    samples_.push_back({start_s, zero});
  }

  // `now_s` never goes back (one steady clock).
  void Record(double now_s, const Counts& counts) {
    if (now_s - samples_.back().t >= spacing_s_) samples_.push_back({now_s, counts});
    while (samples_.size() >= 2 && samples_[1].t <= now_s - window_s_) samples_.pop_front();
  }

  // Records `counts` at `now_s`, then the rates from the base to them; all
  // zero before any time has passed.
  Rates Get(double now_s, const Counts& counts) {
    Record(now_s, counts);
    const Sample& base = samples_.front();
    Rates r;
    if (now_s <= base.t) return r;
    r.span_s = now_s - base.t;
    for (size_t i = 0; i < N; ++i) {
      r.per_s[i] = static_cast<double>(counts[i] - base.counts[i]) / r.span_s;
    }
    return r;
  }

  size_t num_samples() const { return samples_.size(); }

 private:
  struct Sample {
    double t;
    Counts counts;
  };
  double window_s_;
  double spacing_s_;
  std::deque<Sample> samples_;
};

// A feed's window follows the batches and tokens Next() returned and the
// bytes received; a target's, the batches and tokens it delivered.
using FeedWindow = RateWindow<3>;
using TargetWindow = RateWindow<2>;
FeedWindow::Counts WindowCounts(const FeedStats& s);
TargetWindow::Counts WindowCounts(const TargetStats& s);

// Fills `s`'s rates from its totals at `now_s` (seconds since Open; also its
// elapsed_s), recording them in `window`.
void SetRates(double now_s, FeedWindow& window, FeedStats& s);
// The same for a target that joined the feed at `joined_s`: its since-start
// rates are since then.
void SetRates(double now_s, double joined_s, TargetWindow& window, TargetStats& s);

}  // namespace draftfeed
