// gRPC data-plane throughput vs a raw TCP socket moving the same bytes.
//
//   draftfeed-grpc-bench [--tokens 4096 --layers 5 --hidden 5120 --batches 40 --streams 1
//                         --connections 1]
//
// The target side runs a real TargetService, in a process of its own, whose
// engine only fills its output (a memset), so what is timed is the data plane: serialisation,
// HTTP/2 framing, loopback TCP and the client's reassembly into [T, K, H].
// The baseline is a plain TCP socket pair on 127.0.0.1 sending the same
// bytes in chunks of the same size, written here, in the same run.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <malloc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/payload_checksum.h"
#include "draftfeed/client.h"
#include "server/model/model.h"
#include "server/service/target_service.h"

ABSL_FLAG(int64_t, tokens, 4096, "Tokens per batch.");
ABSL_FLAG(int64_t, layers, 5, "Captured layers per token.");
ABSL_FLAG(int64_t, hidden, 5120, "Hidden size (bytes per value: 2).");
ABSL_FLAG(int32_t, batches, 40, "Batches per measurement.");
ABSL_FLAG(int32_t, streams, 1, "Concurrent client streams (one Feed each).");
ABSL_FLAG(int32_t, connections, 1,
          "FeedOptions.connections_per_target of each Feed (streams x connections TCP "
          "connections in all; the TCP baseline uses as many socket pairs).");
ABSL_FLAG(int64_t, chunk_bytes, 4 << 20, "Payload bytes per HiddenChunk / TCP write.");
ABSL_FLAG(int32_t, repeats, 3, "Measurements per mode (median reported).");
ABSL_FLAG(std::string, target_checksum, "device",
          "Where the target's BatchDone checksum comes from: device (a GPU target, which takes "
          "it on the GPU: no pass over the payload on the target's CPU) or host (a CPU target: "
          "one pass per batch on the target's CPU).");
ABSL_FLAG(std::string, read_handoff, "auto",
          "FeedOptions.read_handoff: auto (on with 4 or more cores), on or off.");
ABSL_FLAG(bool, tcp, true, "Measure the raw TCP baseline too (off: gRPC alone, for profiling).");

namespace draftfeed {
namespace {

using Clock = std::chrono::steady_clock;

// An engine that computes nothing: it fills the capture so the bytes are
// real. The target's buffers are pooled, so each is filled once, the first
// time it is seen: the TCP baseline produces no data either, and what is
// compared is moving bytes, not making them. With --target_checksum=device
// it stands in for a GPU target, which checksums the capture on the GPU
// beside its copy to the host (CudaEngine): the checksum comes with the
// buffer (computed once, at the fill, since the content never changes) and
// the target's CPU makes no pass over the payload. With =host it is a CPU
// target: the service checksums every batch on the target's CPU.
class FillEngine final : public Engine {
 public:
  FillEngine(const Model* m, bool device_checksum) : model_(m), device_checksum_(device_checksum) {}
  const Model& model() const override { return *model_; }
  std::string device_name() const override { return "fill"; }
  absl::Status Forward(const ForwardInput& in, std::span<std::byte> out) override {
    Fill(out);
    return absl::OkStatus();
  }
  absl::Status ForwardAsync(const ForwardInput& in, std::span<std::byte> out,
                            CopiedCallback on_copied) override {
    const uint64_t sum = Fill(out);
    on_copied(
        Copied{absl::OkStatus(), device_checksum_ ? std::optional<uint64_t>(sum) : std::nullopt});
    return absl::OkStatus();
  }

 private:
  uint64_t Fill(std::span<std::byte> out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, fresh] = filled_.try_emplace({out.data(), out.size()}, 0);
    if (fresh) {
      std::memset(out.data(), 0x5a, out.size());
      if (device_checksum_) it->second = v1::PayloadChecksum(out.data(), out.size());
    }
    return it->second;
  }

  const Model* model_;
  const bool device_checksum_;
  std::mutex mu_;
  std::map<std::pair<std::byte*, size_t>, uint64_t> filled_;  // buffer -> checksum
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double RawTcpGBps(int64_t total_bytes, int64_t chunk, int streams) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  listen(listener, streams);
  std::vector<int> senders, receivers;
  for (int s = 0; s < streams; ++s) {
    const int c = socket(AF_INET, SOCK_STREAM, 0);
    connect(c, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    receivers.push_back(c);
    senders.push_back(accept(listener, nullptr, nullptr));
  }
  close(listener);
  const int64_t per_stream = total_bytes / streams;
  // Buffers are made (and their pages touched) before the clock starts.
  std::vector<std::vector<char>> send_bufs, recv_bufs;
  for (int s = 0; s < streams; ++s) {
    send_bufs.emplace_back(static_cast<size_t>(chunk), 0x5a);
    // The receiver lands bytes in a batch-sized buffer, as the client does.
    recv_bufs.emplace_back(static_cast<size_t>(std::min<int64_t>(per_stream, 256 << 20)), 0);
  }
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int s = 0; s < streams; ++s) {
    threads.emplace_back([&, s] {
      std::vector<char>& buf = send_bufs[s];
      for (int64_t sent = 0; sent < per_stream;) {
        const ssize_t n = write(senders[s], buf.data(),
                                static_cast<size_t>(std::min<int64_t>(chunk, per_stream - sent)));
        if (n <= 0) break;
        sent += n;
      }
    });
    threads.emplace_back([&, s] {
      std::vector<char>& batch = recv_bufs[s];
      for (int64_t got = 0; got < per_stream;) {
        const size_t off = static_cast<size_t>(got % static_cast<int64_t>(batch.size()));
        const ssize_t n = read(receivers[s], batch.data() + off,
                               std::min(batch.size() - off, static_cast<size_t>(chunk)));
        if (n <= 0) break;
        got += n;
      }
    });
  }
  for (auto& t : threads) t.join();
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  for (int fd : senders) close(fd);
  for (int fd : receivers) close(fd);
  return static_cast<double>(per_stream * streams) / secs / 1e9;
}

constexpr int kCredits = 4;  // per connection

ServiceOptions TargetOptions() {
  ServiceOptions opt;
  opt.max_batch_tokens = absl::GetFlag(FLAGS_tokens);
  opt.chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  // The rounds drain the stream between them, which a trainer never does;
  // the idle pool keeps every buffer the credits can hold, as a target
  // serving this many streams would be configured, so no round starts by
  // allocating what the last one gave back.
  const int64_t batch_bytes =
      absl::GetFlag(FLAGS_tokens) * absl::GetFlag(FLAGS_layers) * absl::GetFlag(FLAGS_hidden) * 2;
  opt.host_pool_bytes = std::max<int64_t>(opt.host_pool_bytes,
                                          int64_t{kCredits} * absl::GetFlag(FLAGS_streams) *
                                              absl::GetFlag(FLAGS_connections) * (batch_bytes + 1));
  return opt;
}

// A model description of the right width (--hidden is checked in main); its
// weights are never read.
absl::StatusOr<std::unique_ptr<Model>> BenchModel() {
  return OpenModel(absl::GetFlag(FLAGS_hidden) == 5120 ? "random:qwen3.6-27b" : "tiny-random");
}

// The target in a process of its own, as deployed: it shares no gRPC threads,
// allocator or locks with the trainer. It writes its address to `report`, then
// serves until `control` closes (the parent exited or is done). It reports
// its capture-buffer allocations so far on each byte read from `control`
// (the trainer finished warming) and once more as it shuts down.
[[noreturn]] void TargetProcess(int control, int report) {
  auto model = BenchModel();
  if (!model.ok()) {
    std::fprintf(stderr, "target: %s\n", std::string(model.status().message()).c_str());
    _exit(1);
  }
  FillEngine engine(model->get(), absl::GetFlag(FLAGS_target_checksum) == "device");
  TargetService service({&engine}, TargetOptions());
  auto [server, address] = ServeOnLoopback(&service);
  const std::string line = address + "\n";
  if (write(report, line.data(), line.size()) != static_cast<ssize_t>(line.size())) _exit(1);
  auto report_allocations = [&] {
    const std::string allocs = std::to_string(service.scheduler().pool().allocations()) + "\n";
    if (write(report, allocs.data(), allocs.size()) < 0) _exit(1);
  };
  char c;
  while (read(control, &c, 1) > 0) report_allocations();
  report_allocations();
  service.BeginDrain();
  server->Shutdown();
  _exit(0);
}

std::string ReadLine(int fd) {
  std::string line;
  char c;
  while (read(fd, &c, 1) == 1 && c != '\n') line.push_back(c);
  return line;
}

int Run(const std::string& address, int control, int report) {
  const int64_t T = absl::GetFlag(FLAGS_tokens), K = absl::GetFlag(FLAGS_layers),
                H = absl::GetFlag(FLAGS_hidden);
  const int batches = absl::GetFlag(FLAGS_batches), streams = absl::GetFlag(FLAGS_streams);
  std::vector<int32_t> layers;
  for (int64_t k = 0; k + 1 < K; ++k) layers.push_back(static_cast<int32_t>(k));
  layers.push_back(-1);
  const int64_t batch_bytes = T * K * H * 2;
  std::vector<double> grpc_gbps, tcp_gbps;
  // Feeds are opened, and their buffer pools warmed by one untimed round,
  // before any timing (twice the window, so every buffer it needs exists):
  // a trainer streams for hours, so the fresh pages of its first batches (a
  // page fault per 4 KiB) are not the steady state. The TCP
  // baseline's buffers are likewise touched before its clock starts.
  std::vector<std::unique_ptr<Feed>> feeds;
  const std::vector<int32_t> ids(static_cast<size_t>(T), 1), lens = {static_cast<int32_t>(T)};
  // Four batches in flight on each connection, as with one: the window must
  // grow with the connections or they only split the same four batches.
  const int window = 4 * absl::GetFlag(FLAGS_connections);
  auto run = [&](Feed& feed, int n) {
    for (int b = 0; b < n; ++b) {
      if (b >= window) (void)feed.Next();
      (void)feed.Submit(ids, lens);
    }
    for (int b = 0; b < std::min(window, n); ++b) (void)feed.Next();
  };
  for (int s = 0; s < streams; ++s) {
    FeedOptions fo;
    fo.targets = {address};
    fo.layers = layers;
    fo.prefetch = window;
    fo.prefetch_bytes = window * batch_bytes;
    fo.credits_per_target = kCredits;
    fo.connections_per_target = absl::GetFlag(FLAGS_connections);
    if (const std::string h = absl::GetFlag(FLAGS_read_handoff); h != "auto") {
      fo.read_handoff = h == "on";
    }
    auto feed = Feed::Open(fo);
    if (!feed.ok()) {
      std::fprintf(stderr, "feed: %s\n", std::string(feed.status().message()).c_str());
      return 1;
    }
    run(**feed, 2 * window + 4);
    feeds.push_back(*std::move(feed));
  }
  if (write(control, "w", 1) != 1) return 1;
  const long long target_allocs0 = std::atoll(ReadLine(report).c_str());
  long grpc_faults = 0;
  for (int rep = 0; rep < absl::GetFlag(FLAGS_repeats); ++rep) {
    rusage ru0{};
    getrusage(RUSAGE_SELF, &ru0);
    std::vector<std::thread> threads;
    const auto t0 = Clock::now();
    for (int s = 0; s < streams; ++s) {
      threads.emplace_back([&, s] { run(*feeds[s], batches); });
    }
    for (auto& t : threads) t.join();
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    rusage ru1{};
    getrusage(RUSAGE_SELF, &ru1);
    grpc_faults += ru1.ru_minflt - ru0.ru_minflt;
    grpc_gbps.push_back(static_cast<double>(batch_bytes) * batches * streams / secs / 1e9);
    if (!absl::GetFlag(FLAGS_tcp)) continue;
    tcp_gbps.push_back(RawTcpGBps(batch_bytes * batches * streams, absl::GetFlag(FLAGS_chunk_bytes),
                                  streams * absl::GetFlag(FLAGS_connections)));
  }
  feeds.clear();  // close the streams before the target shuts down
  close(control);
  const long long target_allocs = std::atoll(ReadLine(report).c_str()) - target_allocs0;
  const double g = Median(grpc_gbps), t = tcp_gbps.empty() ? 0 : Median(tcp_gbps);
  std::printf(
      "payload %lld x %lld x %lld bf16 = %.1f MB per batch, %d batches x %d stream(s) "
      "x %d connection(s), chunks of %lld KiB; target in its own process, checksum on "
      "the %s, read handoff %s\n",
      static_cast<long long>(T), static_cast<long long>(K), static_cast<long long>(H),
      batch_bytes / 1e6, batches, streams, absl::GetFlag(FLAGS_connections),
      static_cast<long long>(absl::GetFlag(FLAGS_chunk_bytes) >> 10),
      absl::GetFlag(FLAGS_target_checksum).c_str(), absl::GetFlag(FLAGS_read_handoff).c_str());
  std::printf(
      "steady state: %lld target buffer allocations, %ld trainer page faults while "
      "gRPC was timed\n",
      target_allocs, grpc_faults);
  if (t > 0) {
    // Each round times gRPC and then TCP back to back; the median of the
    // rounds' ratios is steadier than the ratio of medians on a machine whose
    // speed drifts (shared cores).
    std::vector<double> ratios;
    for (size_t i = 0; i < grpc_gbps.size(); ++i) ratios.push_back(grpc_gbps[i] / tcp_gbps[i]);
    std::printf(
        "gRPC %.2f GB/s, raw TCP %.2f GB/s (medians of %zu): gRPC = %.0f%% of TCP "
        "(median of the rounds' ratios)\n",
        g, t, grpc_gbps.size(), 100 * Median(ratios));
  } else {
    std::printf("gRPC %.2f GB/s (median of %zu; no TCP baseline)\n", g, grpc_gbps.size());
  }
  return 0;
}

}  // namespace
}  // namespace draftfeed

ABSL_FLAG(bool, heap_large_slices, true,
          "mallopt so that gRPC's multi-MiB receive slices come from the heap, not fresh mmaps "
          "(each fresh page is a fault); what draftfeed-target and the client module do.");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_heap_large_slices)) {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 256 << 20);
  }
  if (const std::string c = absl::GetFlag(FLAGS_target_checksum); c != "device" && c != "host") {
    std::fprintf(stderr, "--target_checksum must be device or host, not \"%s\"\n", c.c_str());
    return 1;
  }
  if (const int64_t h = absl::GetFlag(FLAGS_hidden); h != 5120 && h != 128) {
    std::fprintf(stderr, "--hidden must be 5120 or 128\n");
    return 1;
  }
  // Fork before gRPC starts any thread in this process.
  int control[2], report[2];
  if (pipe(control) != 0 || pipe(report) != 0) return 1;
  const pid_t child = fork();
  if (child < 0) return 1;
  if (child == 0) {
    close(control[1]);
    close(report[0]);
    draftfeed::TargetProcess(control[0], report[1]);
  }
  close(control[0]);
  close(report[1]);
  const std::string address = draftfeed::ReadLine(report[0]);
  if (address.empty()) {
    std::fprintf(stderr, "the target process did not start\n");
    return 1;
  }
  const int rc = draftfeed::Run(address, control[1], report[0]);
  close(control[1]);
  int wstatus = 0;
  waitpid(child, &wstatus, 0);
  return rc;
}
