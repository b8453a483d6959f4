#include "server/service/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log_line.h"

namespace draftfeed {

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), buckets_(new std::atomic<int64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0);
}

void Histogram::Observe(double v) {
  // The first bound >= v: Prometheus buckets are "less than or equal".
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
}

std::vector<int64_t> Histogram::cumulative_counts() const {
  std::vector<int64_t> out(bounds_.size() + 1);
  int64_t running = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    running += buckets_[i].load(std::memory_order_relaxed);
    out[i] = running;
  }
  return out;
}

std::vector<double> LatencyBucketsSeconds() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

std::string RenderLabels(const MetricLabels& labels) {
  if (labels.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i > 0) out += ',';
    absl::StrAppend(&out, labels[i].first, "=\"");
    for (char c : labels[i].second) {
      if (c == '\\') {
        out += "\\\\";
      } else if (c == '"') {
        out += "\\\"";
      } else if (c == '\n') {
        out += "\\n";
      } else {
        out += c;
      }
    }
    out += '"';
  }
  out += '}';
  return out;
}

std::string RenderValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    return absl::StrCat(static_cast<int64_t>(v));
  }
  // The shortest form that reads back as the same double.
  for (int precision = 15; precision < 17; ++precision) {
    std::string s = absl::StrFormat("%.*g", precision, v);
    if (std::strtod(s.c_str(), nullptr) == v) return s;
  }
  return absl::StrFormat("%.17g", v);
}

MetricsRegistry::Family& MetricsRegistry::FamilyLocked(absl::string_view name,
                                                       absl::string_view help, Type type) {
  auto it = families_.find(name);
  if (it == families_.end()) {
    it =
        families_.emplace(std::string(name), Family{.type = type, .help = std::string(help)}).first;
  }
  if (it->second.type != type) {
    LogF("draftfeed: metric %s registered twice with different types", std::string(name).c_str());
    std::abort();
  }
  return it->second;
}

Counter* MetricsRegistry::GetCounter(absl::string_view name, absl::string_view help,
                                     const MetricLabels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  std::unique_ptr<Counter>& c =
      FamilyLocked(name, help, Type::kCounter).counters[RenderLabels(labels)];
  if (c == nullptr) c = std::make_unique<Counter>();
  return c.get();
}

Gauge* MetricsRegistry::GetGauge(absl::string_view name, absl::string_view help,
                                 const MetricLabels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  std::unique_ptr<Gauge>& g = FamilyLocked(name, help, Type::kGauge).gauges[RenderLabels(labels)];
  if (g == nullptr) g = std::make_unique<Gauge>();
  return g.get();
}

Histogram* MetricsRegistry::GetHistogram(absl::string_view name, absl::string_view help,
                                         const std::vector<double>& upper_bounds,
                                         const MetricLabels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = FamilyLocked(name, help, Type::kHistogram).histograms[RenderLabels(labels)];
  if (slot.second == nullptr) {
    slot.first = labels;
    slot.second = std::make_unique<Histogram>(upper_bounds);
  }
  return slot.second.get();
}

void MetricsRegistry::DeclareCounter(absl::string_view name, absl::string_view help) {
  std::lock_guard<std::mutex> lock(mu_);
  FamilyLocked(name, help, Type::kCounter);
}

void MetricsRegistry::AddGaugeCallback(absl::string_view name, absl::string_view help,
                                       std::function<std::vector<GaugeSample>()> sample) {
  std::lock_guard<std::mutex> lock(mu_);
  FamilyLocked(name, help, Type::kGauge).callbacks.push_back(std::move(sample));
}

void MetricsRegistry::AddCounterCallback(absl::string_view name, absl::string_view help,
                                         std::function<int64_t()> value) {
  std::lock_guard<std::mutex> lock(mu_);
  FamilyLocked(name, help, Type::kCounter).callbacks.push_back([value = std::move(value)] {
    return std::vector<GaugeSample>{{.value = static_cast<double>(value())}};
  });
}

std::string MetricsRegistry::Render() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    const char* type = f.type == Type::kCounter ? "counter"
                       : f.type == Type::kGauge ? "gauge"
                                                : "histogram";
    absl::StrAppend(&out, "# HELP ", name, " ", f.help, "\n# TYPE ", name, " ", type, "\n");
    for (const auto& [labels, c] : f.counters) {
      absl::StrAppend(&out, name, labels, " ", c->value(), "\n");
    }
    for (const auto& [labels, g] : f.gauges) {
      absl::StrAppend(&out, name, labels, " ", RenderValue(g->value()), "\n");
    }
    for (const auto& cb : f.callbacks) {
      for (const GaugeSample& s : cb()) {
        absl::StrAppend(&out, name, RenderLabels(s.labels), " ", RenderValue(s.value), "\n");
      }
    }
    for (const auto& [key, entry] : f.histograms) {
      const auto& [labels, h] = entry;
      const std::vector<int64_t> cum = h->cumulative_counts();
      for (size_t i = 0; i <= h->upper_bounds().size(); ++i) {
        MetricLabels with_le = labels;
        with_le.emplace_back("le", i < h->upper_bounds().size() ? RenderValue(h->upper_bounds()[i])
                                                                : std::string("+Inf"));
        absl::StrAppend(&out, name, "_bucket", RenderLabels(with_le), " ", cum[i], "\n");
      }
      absl::StrAppend(&out, name, "_sum", key, " ", RenderValue(h->sum()), "\n");
      absl::StrAppend(&out, name, "_count", key, " ", cum.back(), "\n");
    }
  }
  return out;
}

}  // namespace draftfeed
