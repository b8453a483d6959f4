#include "client/src/feed_rates.h"

namespace draftfeed {
namespace {

double PerSecond(int64_t n, double seconds) {
  return seconds > 0 ? static_cast<double>(n) / seconds : 0.0;
}

}  // namespace

FeedWindow::Counts WindowCounts(const FeedStats& s) {
  return {s.delivered, s.tokens_delivered, s.bytes_received};
}

TargetWindow::Counts WindowCounts(const TargetStats& s) {
  return {s.delivered_batches, s.delivered_tokens};
}

void SetRates(double now_s, FeedWindow& window, FeedStats& s) {
  s.elapsed_s = now_s;
  s.batches_per_s = PerSecond(s.delivered, now_s);
  s.tokens_per_s = PerSecond(s.tokens_delivered, now_s);
  s.bytes_per_s = PerSecond(s.bytes_received, now_s);
  const FeedWindow::Rates w = window.Get(now_s, WindowCounts(s));
  s.window_s = w.span_s;
  s.window_batches_per_s = w.per_s[0];
  s.window_tokens_per_s = w.per_s[1];
  s.window_bytes_per_s = w.per_s[2];
}

void SetRates(double now_s, double joined_s, TargetWindow& window, TargetStats& s) {
  s.batches_per_s = PerSecond(s.delivered_batches, now_s - joined_s);
  s.tokens_per_s = PerSecond(s.delivered_tokens, now_s - joined_s);
  const TargetWindow::Rates w = window.Get(now_s, WindowCounts(s));
  s.window_s = w.span_s;
  s.window_batches_per_s = w.per_s[0];
  s.window_tokens_per_s = w.per_s[1];
}

}  // namespace draftfeed
