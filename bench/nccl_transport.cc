// NCCL transport throughput between two GPUs of one host, against NCCL's own
// ncclSend/ncclRecv of the same sizes between the same GPUs, in one run:
//
//   draftfeed-nccl-bench --sizes_mib 64,256 --repeats 5
//
// Baseline: two threads, one 2-rank communicator, plain send/recv loops.
// NcclPeer column: the same loop through the transport's peer (blocking data
// communicator, checksums, polled waits), to split its cost from the
// service's; "nonblocking comm": the same on the nonblocking set-up
// communicator, as transfers ran before the data communicator.
// draftfeed: a TargetService on cuda:0 (random:qwen3-8b weights made on the
// GPU) and a Feed with transport=nccl receiving into cuda:1. Each batch is
// sized to the payload asked (8 layers × T tokens × 4096 × 2 bytes). The
// target posts its send behind the forward on a stream of its own and
// announces the batch when the forward ends; the trainer then posts its
// receive. "draftfeed" is the transfer: the receive's time on the receiving
// GPU, from its post (the send already waiting) to its end, checksum
// included (HiddenBatch::recv_ms). "send+announce" is the target's send_ms:
// from the forward's end to the send's end on the sending GPU, so it adds
// the announcement's gRPC round trip; none of it holds the target up, whose
// next forward runs beside the send. Raw and NcclPeer columns are host wall
// time per transfer in a tight loop. Medians are printed, and the ratio
// draftfeed ÷ raw per size.
#include <cuda_runtime.h>
#include <grpcpp/grpcpp.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/nccl/nccl_peer.h"
#include "draftfeed/client.h"
#include "server/model/cuda_engine.h"
#include "server/model/model.h"
#include "server/service/target_service.h"

ABSL_FLAG(std::string, sizes_mib, "64,256", "Payload sizes per transfer, MiB.");
ABSL_FLAG(int, repeats, 5, "Timed repetitions per size (the median is reported).");
ABSL_FLAG(int, transfers, 8, "Transfers per repetition.");
ABSL_FLAG(std::string, model, "random:qwen3-8b",
          "Target model (hidden size sets the batch shape).");

namespace draftfeed {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

#define CHECK_CUDA(x)                                               \
  do {                                                              \
    cudaError_t e_ = (x);                                           \
    if (e_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                 \
    }                                                               \
  } while (0)
#define CHECK_NCCL(x)                                               \
  do {                                                              \
    ncclResult_t r_ = (x);                                          \
    if (r_ != ncclSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, ncclGetErrorString(r_)); \
      std::exit(1);                                                 \
    }                                                               \
  } while (0)

// One transfer of a rank's buffer on its stream, waited for.
using Transfer = std::function<void(void* buf, cudaStream_t stream)>;

// Two threads, rank r on cuda:r, each moving `transfers` buffers of `bytes`
// per repeat with what `setup(r)` returns (rank 0 sends, rank 1 receives);
// rank 1's GB/s per repeat. Repeat -1 warms up (and connects the GPUs).
std::vector<double> TwoRankRates(size_t bytes, int repeats, int transfers,
                                 const std::function<Transfer(int rank)>& setup) {
  std::vector<double> rates;
  auto rank = [&](int r) {
    CHECK_CUDA(cudaSetDevice(r));
    const Transfer transfer = setup(r);
    void* buf = nullptr;
    CHECK_CUDA(cudaMalloc(&buf, bytes));
    CHECK_CUDA(cudaMemset(buf, r, bytes));
    cudaStream_t s;
    CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (int rep = -1; rep < repeats; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < transfers; ++i) transfer(buf, s);
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r == 1 && rep >= 0) rates.push_back(static_cast<double>(bytes) * transfers / secs / 1e9);
    }
    CHECK_CUDA(cudaStreamDestroy(s));
    CHECK_CUDA(cudaFree(buf));
  };
  std::thread a(rank, 0), b(rank, 1);
  a.join();
  b.join();
  return rates;
}

// Plain ncclSend (cuda:0) -> ncclRecv (cuda:1) on a blocking communicator.
std::vector<double> RawNccl(size_t bytes, int repeats, int transfers) {
  ncclUniqueId id;
  CHECK_NCCL(ncclGetUniqueId(&id));
  return TwoRankRates(bytes, repeats, transfers, [&](int r) -> Transfer {
    ncclComm_t raw;
    CHECK_NCCL(ncclCommInitRank(&raw, 2, id, r));
    std::shared_ptr<ncclComm> comm(raw, [](ncclComm_t c) { ncclCommDestroy(c); });
    return [comm, bytes, r](void* buf, cudaStream_t s) {
      if (r == 0) {
        CHECK_NCCL(ncclSend(buf, bytes, ncclUint8, 1, comm.get(), s));
      } else {
        CHECK_NCCL(ncclRecv(buf, bytes, ncclUint8, 0, comm.get(), s));
      }
      CHECK_CUDA(cudaStreamSynchronize(s));
    };
  });
}

// The same loop through draftfeed's NcclPeer (set up and shaken hands as
// the transport does, payload checksum enqueued beside each transfer, polled
// waits): what the transport's own machinery costs, without the service.
// With `handshake` false the peers skip the handshake, so the transfers run
// on the nonblocking set-up communicator: the design before the blocking
// data communicator, kept as a column to show what that change is worth.
std::vector<double> PeerLoop(size_t bytes, int repeats, int transfers, bool handshake) {
  auto id = NcclPeer::NewUniqueId();
  if (!id.ok()) return {};
  return TwoRankRates(bytes, repeats, transfers, [&](int r) -> Transfer {
    auto started = NcclPeer::Start(*id, r, r);
    absl::Status up = started.ok() ? (*started)->Wait(60) : started.status();
    if (up.ok() && handshake) up = (*started)->Handshake(60);
    if (!up.ok()) {
      std::fprintf(stderr, "NcclPeer setup failed: %s\n", std::string(up.message()).c_str());
      std::exit(1);
    }
    std::shared_ptr<NcclPeer> peer = *std::move(started);
    return [peer, bytes, r](void* buf, cudaStream_t s) {
      auto sum = r == 0 ? peer->Send(buf, bytes, s, 60) : peer->Recv(buf, bytes, s, 60);
      if (!sum.ok()) std::exit(1);
    };
  });
}

int Main() {
  if (CudaDeviceCount() < 2) {
    std::fprintf(stderr, "draftfeed-nccl-bench needs two CUDA devices; this host has %d\n",
                 CudaDeviceCount());
    return 2;
  }
  std::vector<int64_t> sizes;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_sizes_mib), ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 1) {
      std::fprintf(stderr, "--sizes_mib: '%s' is not a positive integer\n",
                   std::string(part).c_str());
      return 2;
    }
    sizes.push_back(v);
  }
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  const int transfers = std::max(1, absl::GetFlag(FLAGS_transfers));

  std::printf("loading %s on cuda:0 ...\n", absl::GetFlag(FLAGS_model).c_str());
  auto model = OpenModel(absl::GetFlag(FLAGS_model));
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  const int64_t H = (*model)->config.hidden_size;
  const int K = 8;
  const int64_t max_tokens = (*std::max_element(sizes.begin(), sizes.end()) << 20) / (K * H * 2);
  CudaEngineOptions copt;
  copt.device = 0;
  copt.max_tokens = max_tokens;
  copt.max_layers = K;
  auto engine = CudaEngine::Create(model->get(), copt);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", std::string(engine.status().message()).c_str());
    return 1;
  }
  ServiceOptions options;
  options.max_batch_tokens = max_tokens;
  TargetService service({engine->get()}, options);
  auto [server, address] = ServeOnLoopback(&service);

  std::vector<int32_t> layers;
  const int64_t L = (*model)->config.num_layers;
  for (int i = 0; i < K; ++i) layers.push_back(static_cast<int32_t>((i + 1) * L / (K + 1)));

  std::printf("%10s %10s %16s %16s %16s %8s %16s %16s\n", "size MiB", "raw GB/s", "NcclPeer GB/s",
              "nonblocking comm", "draftfeed GB/s", "ratio", "send+announce", "batch e2e GB/s");
  for (int64_t mib : sizes) {
    const int64_t T = (mib << 20) / (K * H * 2);
    const size_t bytes = static_cast<size_t>(T * K * H * 2);
    const std::vector<double> raw = RawNccl(bytes, repeats, transfers);
    const std::vector<double> peer = PeerLoop(bytes, repeats, transfers, true);
    const std::vector<double> setup_comm = PeerLoop(bytes, repeats, transfers, false);

    FeedOptions opt;
    opt.targets = {address};
    opt.layers = layers;
    opt.transport = Transport::kNccl;
    opt.cuda_device = 1;
    opt.prefetch = 2;
    opt.prefetch_bytes = static_cast<int64_t>(bytes) * 2;
    auto feed = Feed::Open(opt);
    if (!feed.ok()) {
      std::fprintf(stderr, "feed: %s\n", std::string(feed.status().message()).c_str());
      return 1;
    }
    std::mt19937 rng(static_cast<uint32_t>(mib));
    std::vector<int32_t> tokens(static_cast<size_t>(T));
    for (auto& t : tokens) t = static_cast<int32_t>(rng() % 1000);
    std::vector<double> recv_rates, send_rates, e2e_rates;
    for (int rep = -1; rep < repeats; ++rep) {
      double recv_ms = 0, send_ms = 0;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < transfers; ++i) {
        if (!(*feed)->Submit(tokens, {static_cast<int32_t>(T)}).ok()) return 1;
        auto b = (*feed)->Next();
        if (!b.ok()) {
          std::fprintf(stderr, "batch: %s\n", std::string(b.status().message()).c_str());
          return 1;
        }
        recv_ms += b->recv_ms;
        send_ms += b->send_ms;
      }
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rep >= 0) {
        recv_rates.push_back(static_cast<double>(bytes) * transfers / (recv_ms / 1e3) / 1e9);
        send_rates.push_back(static_cast<double>(bytes) * transfers / (send_ms / 1e3) / 1e9);
        e2e_rates.push_back(static_cast<double>(bytes) * transfers / secs / 1e9);
      }
    }
    (void)(*feed)->Close();
    const double r = Median(raw), d = Median(recv_rates);
    std::printf("%10lld %10.1f %16.1f %16.1f %16.1f %8.3f %16.1f %16.1f\n",
                static_cast<long long>(mib), r, Median(peer), Median(setup_comm), d,
                r > 0 ? d / r : 0, Median(send_rates), Median(e2e_rates));
    std::fflush(stdout);
  }
  service.BeginDrain();
  server->Shutdown();
  service.StopScheduler();
  return 0;
}

}  // namespace
}  // namespace draftfeed

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "NCCL transport vs plain ncclSend/ncclRecv between cuda:0 and cuda:1 (needs 2 GPUs).");
  absl::ParseCommandLine(argc, argv);
  return draftfeed::Main();
}
