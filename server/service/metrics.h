// A small metrics registry rendered in the Prometheus text exposition format
// (version 0.0.4): counters, gauges and fixed-bucket histograms. Increments
// and observations are relaxed atomics, so the serving paths never take a
// lock; a lock is taken only to create a series and to render.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace draftfeed {

// Label name/value pairs of one series, in the order given.
using MetricLabels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void Add(int64_t n = 1) { value_.fetch_add(n, std::memory_order_relaxed); }
  int64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> value_{0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double d) { value_.fetch_add(d, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// Cumulative buckets with fixed upper bounds (ascending); +Inf is implied.
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double v);
  const std::vector<double>& upper_bounds() const { return bounds_; }
  // Observations <= each bound (cumulative), then the total count.
  std::vector<int64_t> cumulative_counts() const;
  int64_t count() const { return count_.load(std::memory_order_relaxed); }
  double sum() const { return sum_.load(std::memory_order_relaxed); }

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<int64_t>[]> buckets_;  // per bucket, not cumulative; last is +Inf
  std::atomic<int64_t> count_{0};
  std::atomic<double> sum_{0};
};

// Seconds from 0.5 ms to 60 s, roughly x2.5 apart: a tiny model's forward on
// CPU to a 16k-token batch of a large model, and the slow sends in between.
std::vector<double> LatencyBucketsSeconds();

// One value of a gauge sampled when /metrics is read.
struct GaugeSample {
  MetricLabels labels;
  double value = 0;
};

class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // The series of `name` with `labels`, made on first use; the pointer stays
  // valid for the registry's life. A name keeps the type and help it was
  // first registered with; asking for it as another type is a programming
  // error and aborts.
  Counter* GetCounter(absl::string_view name, absl::string_view help,
                      const MetricLabels& labels = {});
  Gauge* GetGauge(absl::string_view name, absl::string_view help, const MetricLabels& labels = {});
  Histogram* GetHistogram(absl::string_view name, absl::string_view help,
                          const std::vector<double>& upper_bounds, const MetricLabels& labels = {});
  // A counter family whose series are made later (by label, as events
  // happen): its HELP and TYPE are exported from the start, so dashboards
  // and alerts see the name before the first event.
  void DeclareCounter(absl::string_view name, absl::string_view help);
  // A gauge whose samples `sample` returns at each Render (called under the
  // registry's lock: it must not call back into the registry).
  void AddGaugeCallback(absl::string_view name, absl::string_view help,
                        std::function<std::vector<GaugeSample>()> sample);
  // A counter (one series, no labels) whose value `value` returns at each
  // Render, for a count kept elsewhere that only grows (the same rules as a
  // gauge callback).
  void AddCounterCallback(absl::string_view name, absl::string_view help,
                          std::function<int64_t()> value);

  // Every family in name order: # HELP, # TYPE, then its samples.
  std::string Render() const;

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Family {
    Type type;
    std::string help;
    std::map<std::string, std::unique_ptr<Counter>> counters;  // by rendered labels
    std::map<std::string, std::unique_ptr<Gauge>> gauges;
    std::map<std::string, std::pair<MetricLabels, std::unique_ptr<Histogram>>> histograms;
    std::vector<std::function<std::vector<GaugeSample>()>> callbacks;
  };
  Family& FamilyLocked(absl::string_view name, absl::string_view help, Type type);

  mutable std::mutex mu_;
  std::map<std::string, Family, std::less<>> families_;
};

// `{a="x",b="y"}` (empty for no labels), values escaped as the format says.
std::string RenderLabels(const MetricLabels& labels);
// A sample value as the format writes it (+Inf, -Inf, NaN, integers without
// a fraction).
std::string RenderValue(double v);

}  // namespace draftfeed
