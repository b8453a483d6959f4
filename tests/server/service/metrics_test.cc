// The metrics registry's text exposition, series identity, histogram buckets
// and concurrent increments; the HTTP endpoint's GET /metrics; the target's
// stream and throughput log lines.
#include "server/service/metrics.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/log_line.h"
#include "server/service/metrics_http.h"
#include "server/service/target_metrics.h"

namespace draftfeed {
namespace {

TEST(MetricsRegistry, RendersCountersGaugesAndCallbacksInNameOrder) {
  MetricsRegistry r;
  r.GetCounter("b_total", "Bs.", {{"code", "OK"}})->Add(3);
  r.GetCounter("b_total", "ignored", {{"code", "INTERNAL"}})->Add();
  r.GetGauge("a_gauge", "An a.")->Set(2.5);
  r.AddGaugeCallback("c_now", "Cs.", [] {
    return std::vector<GaugeSample>{{.labels = {{"dev", "cuda:0"}}, .value = 7}};
  });
  EXPECT_EQ(r.Render(),
            "# HELP a_gauge An a.\n# TYPE a_gauge gauge\na_gauge 2.5\n"
            "# HELP b_total Bs.\n# TYPE b_total counter\n"
            "b_total{code=\"INTERNAL\"} 1\nb_total{code=\"OK\"} 3\n"
            "# HELP c_now Cs.\n# TYPE c_now gauge\nc_now{dev=\"cuda:0\"} 7\n");
}

TEST(MetricsRegistry, ADeclaredFamilyIsExportedBeforeItsFirstSeries) {
  MetricsRegistry r;
  r.DeclareCounter("errors_total", "Errors by code.");
  EXPECT_EQ(r.Render(), "# HELP errors_total Errors by code.\n# TYPE errors_total counter\n");
  r.GetCounter("errors_total", "", {{"code", "INTERNAL"}})->Add();
  EXPECT_EQ(r.Render(),
            "# HELP errors_total Errors by code.\n# TYPE errors_total counter\n"
            "errors_total{code=\"INTERNAL\"} 1\n");
}

TEST(MetricsRegistry, ACounterCallbackIsTypedCounter) {
  MetricsRegistry r;
  int64_t skipped = 2;
  r.AddCounterCallback("skipped_total", "Skipped.", [&skipped] { return skipped; });
  EXPECT_EQ(r.Render(), "# HELP skipped_total Skipped.\n# TYPE skipped_total counter\n"
                        "skipped_total 2\n");
  skipped = 5;  // read at each render
  EXPECT_EQ(r.Render(), "# HELP skipped_total Skipped.\n# TYPE skipped_total counter\n"
                        "skipped_total 5\n");
}

TEST(MetricsRegistry, TheSameNameAndLabelsIsTheSameSeries) {
  MetricsRegistry r;
  Counter* a = r.GetCounter("x_total", "X.", {{"t", "grpc"}});
  EXPECT_EQ(a, r.GetCounter("x_total", "X.", {{"t", "grpc"}}));
  EXPECT_NE(a, r.GetCounter("x_total", "X.", {{"t", "nccl"}}));
  EXPECT_NE(a, r.GetCounter("x_total", "X."));
}

TEST(MetricsRegistry, HistogramBucketsAreCumulativeAndInclusive) {
  MetricsRegistry r;
  Histogram* h = r.GetHistogram("lat_seconds", "L.", {0.1, 1, 10});
  for (double v : {0.05, 0.1, 0.5, 1.0, 3.0, 100.0}) h->Observe(v);
  EXPECT_EQ(h->cumulative_counts(), (std::vector<int64_t>{2, 4, 5, 6}));
  EXPECT_EQ(r.Render(),
            "# HELP lat_seconds L.\n# TYPE lat_seconds histogram\n"
            "lat_seconds_bucket{le=\"0.1\"} 2\nlat_seconds_bucket{le=\"1\"} 4\n"
            "lat_seconds_bucket{le=\"10\"} 5\nlat_seconds_bucket{le=\"+Inf\"} 6\n"
            "lat_seconds_sum 104.65\nlat_seconds_count 6\n");
}

TEST(MetricsRegistry, LabelValuesAreEscaped) {
  EXPECT_EQ(RenderLabels({{"client", "a\"b\\c\nd"}, {"x", ""}}),
            "{client=\"a\\\"b\\\\c\\nd\",x=\"\"}");
  EXPECT_EQ(RenderLabels({}), "");
}

TEST(MetricsRegistry, ValuesAsTheFormatWritesThem) {
  EXPECT_EQ(RenderValue(42), "42");
  EXPECT_EQ(RenderValue(-3), "-3");
  EXPECT_EQ(RenderValue(0.1), "0.1");
  EXPECT_EQ(RenderValue(1e20), "1e+20");
  EXPECT_EQ(RenderValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(RenderValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(RenderValue(std::nan("")), "NaN");
  const double third = 1.0 / 3;
  EXPECT_EQ(std::stod(RenderValue(third)), third);  // round trips
}

TEST(MetricsRegistry, ConcurrentIncrementsAreAllCounted) {
  MetricsRegistry r;
  Counter* c = r.GetCounter("n_total", "N.");
  Histogram* h = r.GetHistogram("h_seconds", "H.", {0.5});
  Gauge* g = r.GetGauge("g", "G.");
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 10000; ++i) {
        c->Add(2);
        h->Observe(t % 2 == 0 ? 0.25 : 1.0);
        g->Add(1);
        // Renders and new series concurrently with the increments.
        if (i % 2500 == 0) {
          r.GetCounter("n_total", "N.", {{"t", std::to_string(t)}})->Add();
          (void)r.Render();
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(c->value(), 8 * 10000 * 2);
  EXPECT_EQ(h->cumulative_counts(), (std::vector<int64_t>{40000, 80000}));
  EXPECT_DOUBLE_EQ(h->sum(), 40000 * 0.25 + 40000 * 1.0);
  EXPECT_EQ(g->value(), 80000);
  EXPECT_EQ(r.GetCounter("n_total", "N.", {{"t", "3"}})->value(), 4);
}

TEST(MetricsRegistryDeathTest, OneNameOneType) {
  MetricsRegistry r;
  r.GetCounter("m", "M.");
  EXPECT_DEATH(r.GetGauge("m", "M."), "registered twice with different types");
}

// GET over a plain socket: what a Prometheus scrape sends.
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "connect failed";
  }
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
  close(fd);
  return out;
}

TEST(MetricsHttpServer, ServesTheRenderAtMetricsOnly) {
  MetricsRegistry r;
  Counter* c = r.GetCounter("hits_total", "Hits.");
  auto server = MetricsHttpServer::Start("127.0.0.1:0", [&] { return r.Render(); });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);
  c->Add(5);
  const std::string got = HttpGet(port, "/metrics");
  EXPECT_NE(got.find("HTTP/1.1 200"), std::string::npos) << got;
  EXPECT_NE(got.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << got;
  EXPECT_NE(got.find("\r\n\r\n# HELP hits_total Hits.\n# TYPE hits_total counter\nhits_total 5\n"),
            std::string::npos)
      << got;
  EXPECT_NE(HttpGet(port, "/").find("HTTP/1.1 404"), std::string::npos);
  // A second server cannot take the port while the first serves.
  auto second = MetricsHttpServer::Start("127.0.0.1:" + std::to_string(port), [] { return ""; });
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("cannot listen"), std::string::npos);
  server->reset();  // stops and joins
  EXPECT_EQ(HttpGet(port, "/metrics"), "connect failed");
}

TEST(MetricsHttpServer, BadAddressesNameTheFlag) {
  for (const char* bad : {"", "9400", ":9400", "host:", "host:x", "host:70000", "host:-1"}) {
    auto s = MetricsHttpServer::ParseListen(bad);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("--metrics_listen="), std::string::npos);
  }
  auto v6 = MetricsHttpServer::ParseListen("[::1]:9400");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->first, "::1");
  EXPECT_EQ(v6->second, 9400);
}

TEST(TargetLogLines, StreamClosedAndRefused) {
  StreamSummary s{.peer = "ipv4:10.0.0.2:5000",
                  .client_name = "trainer-3",
                  .token_name = "team-a",
                  .transport = v1::TRANSPORT_NCCL,
                  .layers = {1, 16, -1},
                  .encoding = v1::ENCODING_FP8_E4M3,
                  .batches = 12,
                  .tokens = 4096,
                  .payload_bytes = 3 << 20,
                  .batch_errors = 1,
                  .seconds = 1.5};
  EXPECT_EQ(StreamClosedText(s),
            "draftfeed-target: stream closed from ipv4:10.0.0.2:5000 token team-a client "
            "'trainer-3': transport nccl, layers 1,16,-1, fp8_e4m3: 12 batches, 4096 tokens, 3.0 "
            "MiB in 1.50 s, 1 batch errors: OK");
  // The line printed is the text after the time it is printed at.
  const std::string before = LogTimestamp(std::chrono::system_clock::now());
  const std::string line = StreamClosedLine(s);
  const std::string after = LogTimestamp(std::chrono::system_clock::now());
  ASSERT_GT(line.size(), before.size());
  EXPECT_LE(before, line.substr(0, before.size()));
  EXPECT_LE(line.substr(0, before.size()), after);
  EXPECT_EQ(line[before.size()], ' ');
  EXPECT_EQ(line.substr(before.size() + 1), StreamClosedText(s));
  s.status = absl::CancelledError("client went away");
  EXPECT_NE(StreamClosedText(s).find(": CANCELLED: client went away"), std::string::npos);
  StreamSummary refused{.peer = "ipv4:10.0.0.2:5001",
                        .refused = true,
                        .status = absl::ResourceExhaustedError("at most --max_streams=2")};
  EXPECT_EQ(StreamClosedText(refused),
            "draftfeed-target: stream refused from ipv4:10.0.0.2:5001: RESOURCE_EXHAUSTED: at "
            "most --max_streams=2");
}

TEST(TargetLogLines, Throughput) {
  EXPECT_EQ(ThroughputLogger::Line(60, 120, 1966080, 5 << 20, 3, 7, 2),
            "draftfeed-target: last 60 s: 120 batches, 1966080 tokens (32768 tok/s), 5.0 MiB "
            "sent; 3 streams open, 7 credits in use, 2 batches queued");
  EXPECT_NE(ThroughputLogger::Line(0, 0, 0, 0, 0, 0, 0).find("(0 tok/s)"), std::string::npos);
}

TEST(TargetMetrics, CountsByTransportAndCode) {
  TargetMetrics m;
  m.CountBatchServed(v1::TRANSPORT_GRPC, 100, 1000, 0.001, 0.01, 0.002);
  m.CountBatchServed(v1::TRANSPORT_NCCL, 50, 500, 0.001, 0.01, 0.002);
  m.CountBatchError(absl::StatusCode::kInvalidArgument);
  m.CountBatchError(absl::StatusCode::kInvalidArgument);
  m.CountStreamRefused(absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(m.batches_served(), 2);
  EXPECT_EQ(m.tokens_served(), 150);
  EXPECT_EQ(m.payload_bytes(), 1500);
  const std::string text = m.registry().Render();
  for (const char* line : {"draftfeed_payload_bytes_total{transport=\"grpc\"} 1000\n",
                           "draftfeed_payload_bytes_total{transport=\"nccl\"} 500\n",
                           "draftfeed_batch_errors_total{code=\"INVALID_ARGUMENT\"} 2\n",
                           "draftfeed_streams_refused_total{code=\"UNAUTHENTICATED\"} 1\n",
                           "draftfeed_forward_seconds_bucket{le=\"0.01\"} 2\n",
                           "draftfeed_forward_seconds_bucket{le=\"0.005\"} 0\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << text;
  }
}

}  // namespace
}  // namespace draftfeed
