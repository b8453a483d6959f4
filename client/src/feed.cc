#include <google/protobuf/io/coded_stream.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/proto_buffer_reader.h>
#include <netdb.h>
#include <sys/socket.h>
#include <arpa/inet.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "draftfeed/client.h"
#include "common/payload_checksum.h"
#include "draftfeed/v1/draftfeed.grpc.pb.h"
#include "common/host_buffer_pool.h"
#include "common/thread_name.h"
#if DRAFTFEED_HAVE_NCCL
#include <cuda_runtime.h>

#include "server/nccl/nccl_peer.h"
#endif

namespace draftfeed {

namespace {

using Clock = std::chrono::steady_clock;
// The data stream is read raw so that payload bytes go from gRPC's slices
// straight into the batch buffer (one copy), not through a protobuf string.
using Stream = grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;
constexpr char kStreamMethod[] = "/draftfeed.v1.TargetService/StreamHiddenStates";

grpc::ByteBuffer ToBuffer(const google::protobuf::Message& msg) {
  const std::string bytes = msg.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

bool ParseBuffer(grpc::ByteBuffer& bb, google::protobuf::Message* msg) {
  grpc::ProtoBufferReader reader(&bb);
  return msg->ParseFromZeroCopyStream(&reader);
}

absl::Status FromGrpc(const grpc::Status& s, const std::string& context) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(context, ": ", s.error_message()));
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // Each target gets its own connection even when two share an address.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  // HTTP/2 DATA frames of up to 16 MiB instead of 16 KiB: a 4 MiB chunk then
  // arrives as one frame, not 256, so both ends parse, slice and syscall far
  // less per byte (bench/grpc_throughput.cc: +5..12 points of raw TCP).
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, (1 << 24) - 1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

std::chrono::system_clock::time_point DeadlineIn(double s) {
  return std::chrono::system_clock::now() +
         std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

TargetDescription Describe(const std::string& address, const v1::TargetInfo& info) {
  TargetDescription d;
  d.address = address;
  d.model_id = info.model_id();
  d.architecture = info.architecture();
  d.fingerprint = info.fingerprint();
  d.server_version = info.server_version();
  d.num_layers = info.num_layers();
  d.hidden_size = info.hidden_size();
  d.vocab_size = info.vocab_size();
  d.max_batch_tokens = info.max_batch_tokens();
  d.devices.assign(info.devices().begin(), info.devices().end());
  d.layer_types.assign(info.layer_types().begin(), info.layer_types().end());
  return d;
}

absl::StatusOr<TargetDescription> QueryInfo(v1::TargetService::Stub* stub,
                                            const std::string& address, double timeout_s,
                                            bool wait_for_ready) {
  grpc::ClientContext ctx;
  ctx.set_deadline(DeadlineIn(timeout_s));
  ctx.set_wait_for_ready(wait_for_ready);
  v1::TargetInfo info;
  grpc::Status s = stub->GetTargetInfo(&ctx, v1::GetTargetInfoRequest(), &info);
  if (!s.ok()) return FromGrpc(s, absl::StrCat("target ", address, ": GetTargetInfo"));
  return Describe(address, info);
}

// "dns:///name:port" -> every address the name resolves to, as "ip:port".
absl::StatusOr<std::vector<std::string>> ExpandTarget(const std::string& target) {
  constexpr std::string_view kDns = "dns:///";
  if (target.rfind(kDns, 0) != 0) return std::vector<std::string>{target};
  const std::string rest = target.substr(kDns.size());
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("target ", target, " has no :port"));
  }
  const std::string host = rest.substr(0, colon);
  const std::string port = rest.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", target, ": ", gai_strerror(rc)));
  }
  std::set<std::string> out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, buf, sizeof buf);
      out.insert(absl::StrCat(buf, ":", port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, buf,
                sizeof buf);
      out.insert(absl::StrCat("[", buf, "]:", port));
    }
  }
  freeaddrinfo(res);
  return std::vector<std::string>(out.begin(), out.end());
}

}  // namespace

absl::StatusOr<TargetDescription> DescribeTarget(const std::string& address, double timeout_s) {
  auto stub = v1::TargetService::NewStub(MakeChannel(address));
  return QueryInfo(stub.get(), address, timeout_s, /*wait_for_ready=*/true);
}

struct Feed::Impl {
  // Messages a gRPC connection reads ahead of its processor (chunks are
  // chunk_bytes each, 4 MiB by default).
  static constexpr size_t kReadAheadMessages = 4;

  // One stream to one target. Its reader thread owns the end of the stream;
  // its writer thread sends queued batches so no lock is held across Write.
  struct Conn {
    grpc::ClientContext ctx;
    std::unique_ptr<Stream> stream;
    std::thread reader;
    std::thread writer;
    std::mutex wmu;
    std::condition_variable wcv;
    std::deque<grpc::ByteBuffer> wq;
    bool wclosed = false;  // writer: send what is queued, then WritesDone
    bool finished = false;  // reader is done (guarded by Impl::mu)
#if DRAFTFEED_HAVE_NCCL
    std::unique_ptr<NcclPeer> nccl;  // TRANSPORT_NCCL streams
    cudaStream_t cuda_stream = nullptr;
    // Receives posted by the reader as batches are announced, completed in
    // order by `waiter` (so the reader keeps reading BatchDone meanwhile).
    struct Posted {
      uint64_t batch_id = 0;
      int64_t tokens = 0;
      std::shared_ptr<uint16_t> buffer;
      NcclPeer::Op op;
    };
    std::mutex rmu;
    std::condition_variable rcv;
    std::deque<Posted> posted;
    bool rclosed = false;
    std::thread waiter;
    ~Conn() {
      nccl.reset();
      if (cuda_stream != nullptr) cudaStreamDestroy(cuda_stream);
    }
#endif
    bool uses_nccl() const {
#if DRAFTFEED_HAVE_NCCL
      return nccl != nullptr;
#else
      return false;
#endif
    }
  };

  enum class State { kConnecting, kLive, kDown, kRefused };

  struct Target {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::TargetService::Stub> stub;
    TargetDescription info;
    State state = State::kConnecting;
    std::shared_ptr<Conn> conn;
    int32_t credits = 1;
    int64_t attempts = 0;
    double backoff_s = 0;
    Clock::time_point next_attempt{};
    std::thread connector;
    absl::Status refusal;  // why it is kRefused
    double rate_tps = 0;   // EWMA of tokens / forward time; 0 = not measured yet
    TargetStats stats;
  };

  struct Pending {
    std::vector<int32_t> token_ids;
    std::vector<int32_t> seq_lens;
    std::shared_ptr<uint16_t> hidden;  // from the pool, T*K*H values (gRPC streams)
    std::shared_ptr<uint16_t> device;  // from the device pool (NCCL streams)
    uint64_t device_checksum = 0;      // computed on the GPU as it arrived
    bool recv_pending = false;         // announced by NCCL, not yet received
    uint64_t epoch = 0;                // bumped whenever the batch is unassigned
    std::optional<v1::BatchDone> early_done;  // BatchDone that beat its receive
    size_t values = 0;
    // Checksum fed chunk by chunk while the bytes are in cache; valid while
    // chunks arrive in order (otherwise the batch is re-hashed whole).
    v1::PayloadHasher hasher;
    bool hashed_in_order = true;
    int64_t tokens_received = 0;
    Target* target = nullptr;
    Conn* conn = nullptr;
    Clock::time_point last_progress{};
    bool complete = false;
    absl::Status error;
    HiddenBatch result;
  };

  FeedOptions options;
  bool read_handoff = false;  // options.read_handoff, resolved
  // Result buffers: reused across batches (a fresh 200 MB buffer per batch
  // would cost a page fault per 4 KiB); idle memory capped at 2x prefetch_bytes.
  std::unique_ptr<HostBufferPool> pool;
  std::unique_ptr<HostBufferPool> device_pool;  // NCCL results, on options.cuda_device
  std::string fingerprint;  // every target must serve this
  std::string fingerprint_source;
  int32_t hidden_size = 0;
  Clock::time_point opened_at = Clock::now();

  mutable std::mutex mu;
  std::condition_variable cv;
  std::vector<std::unique_ptr<Target>> targets;
  std::vector<std::string> dns_targets;
  Clock::time_point next_dns_refresh{};
  std::map<uint64_t, Pending> pending;  // by batch id = submission order
  std::set<uint64_t> unassigned;        // pending, not on any target
  std::vector<std::shared_ptr<Conn>> dead_conns;  // threads still to join
  uint64_t next_id = 1;
  int64_t outstanding_bytes = 0;
  FeedStats stats;
  absl::Status fatal;  // sticky: no target for unavailable_timeout_s
  std::optional<Clock::time_point> no_target_since;
  std::atomic<bool> closing{false};  // set under mu; NCCL waits read it without
  std::thread supervisor;

  int64_t K() const { return static_cast<int64_t>(options.layers.size()); }

  // ---- connecting ----------------------------------------------------------

  // One Target per (address, connection): with connections_per_target > 1
  // each connection is its own stream, TCP connection and credits, and the
  // dispatcher spreads batches over them like over separate targets.
  void AddTargetLocked(const std::string& address) {
    for (auto& t : targets) {
      if (t->address == address) return;
    }
    for (int32_t i = 0; i < options.connections_per_target; ++i) {
      auto t = std::make_unique<Target>();
      t->address = address;
      t->stats.address = i == 0 ? address : absl::StrCat(address, " #", i + 1);
      t->channel = MakeChannel(address);  // local subchannel pool: a connection of its own
      t->stub = v1::TargetService::NewStub(t->channel);
      t->backoff_s = options.reconnect_backoff_min_s;
      Target* raw = t.get();
      targets.push_back(std::move(t));
      raw->connector = std::thread([this, raw] {
        NameThisThread("df-connect");
        ConnectLoop(raw);
      });
    }
  }

  void ConnectLoop(Target* t) {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      if (closing) return;
      if (t->state == State::kLive || t->state == State::kRefused) {
        cv.wait(lock);
        continue;
      }
      if (Clock::now() < t->next_attempt) {
        cv.wait_until(lock, t->next_attempt);
        continue;
      }
      const bool first = t->attempts++ == 0;
      lock.unlock();
      absl::Status s = ConnectOnce(t, first);
      lock.lock();
      if (s.ok() || closing) continue;
      t->stats.last_error = std::string(s.message());
      if (s.code() == absl::StatusCode::kFailedPrecondition ||
          s.code() == absl::StatusCode::kInvalidArgument) {
        t->state = State::kRefused;  // another model or a layer it lacks: never use it
        t->refusal = s;
      } else {
        t->state = State::kDown;
        t->next_attempt = Clock::now() + std::chrono::milliseconds(
                                             static_cast<int64_t>(t->backoff_s * 1000));
        t->backoff_s = std::min(t->backoff_s * 2, options.reconnect_backoff_max_s);
      }
      cv.notify_all();
    }
  }

  absl::Status ConnectOnce(Target* t, bool first) {
    // The first attempt waits for a target that is still starting; later ones
    // fail fast and back off.
    auto info = QueryInfo(t->stub.get(), t->address,
                          first ? options.connect_timeout_s
                                : std::min(options.connect_timeout_s, 5.0),
                          /*wait_for_ready=*/first);
    if (!info.ok()) return info.status();
    {
      std::lock_guard<std::mutex> lock(mu);
      if (fingerprint.empty()) {
        fingerprint = info->fingerprint;
        fingerprint_source = absl::StrCat(t->address, " (", info->model_id, ")");
        hidden_size = info->hidden_size;
      }
      if (info->fingerprint != fingerprint) {
        return absl::FailedPreconditionError(absl::StrCat(
            "target ", t->address, " serves ", info->model_id, " (fingerprint ",
            info->fingerprint, ") but the feed expects fingerprint ", fingerprint,
            fingerprint_source.empty() ? "" : absl::StrCat(", served by ", fingerprint_source),
            "; refusing it"));
      }
    }
    auto conn = std::make_shared<Conn>();
    const grpc::internal::RpcMethod method(kStreamMethod,
                                           grpc::internal::RpcMethod::BIDI_STREAMING, t->channel);
    conn->stream.reset(grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
        t->channel.get(), method, &conn->ctx));
    v1::StreamRequest req;
    v1::Open* open = req.mutable_open();
    for (int32_t l : options.layers) open->add_layers(l);
    open->set_encoding(v1::ENCODING_BF16);
    open->set_transport(v1::TRANSPORT_GRPC);
    open->set_expected_fingerprint(info->fingerprint);
    open->set_max_inflight_batches(options.credits_per_target);
    open->set_client_name(options.client_name);
#if DRAFTFEED_HAVE_NCCL
    std::unique_ptr<NcclPeer> peer;
    std::string unique_id;
    if (options.transport != Transport::kGrpc) {
      auto id = NcclPeer::NewUniqueId();
      if (!id.ok()) {
        if (options.transport == Transport::kNccl) return id.status();
      } else {
        unique_id = *std::move(id);
        open->set_transport(options.transport == Transport::kNccl ? v1::TRANSPORT_NCCL
                                                                  : v1::TRANSPORT_AUTO);
        open->set_nccl_unique_id(unique_id);
        open->set_host_id(LocalHostId());
        open->set_gpu_uuid(CudaDeviceUuid(options.cuda_device));
      }
    }
#endif
    v1::StreamResponse resp;
    grpc::ByteBuffer raw;
    if (!conn->stream->Write(ToBuffer(req))) {
      return FromGrpc(conn->stream->Finish(), absl::StrCat("target ", t->address, ": open stream"));
    }
#if DRAFTFEED_HAVE_NCCL
    // Join as rank 1 now: the target joins as rank 0 before it answers Opened.
    if (!unique_id.empty()) {
      auto started = NcclPeer::Start(unique_id, NcclPeer::kReceiverRank, options.cuda_device);
      if (!started.ok()) {
        conn->ctx.TryCancel();
        conn->stream->Finish();
        return started.status();
      }
      peer = *std::move(started);
    }
#endif
    if (!conn->stream->Read(&raw)) {
      return FromGrpc(conn->stream->Finish(), absl::StrCat("target ", t->address, ": open stream"));
    }
    if (!ParseBuffer(raw, &resp) || resp.msg_case() != v1::StreamResponse::kOpened) {
      conn->ctx.TryCancel();
      conn->stream->Finish();
      return absl::InternalError(absl::StrCat("target ", t->address, ": expected Opened"));
    }
    std::string transport = "grpc";
#if DRAFTFEED_HAVE_NCCL
    if (resp.opened().transport() == v1::TRANSPORT_NCCL) {
      if (peer == nullptr) {
        conn->ctx.TryCancel();
        conn->stream->Finish();
        return absl::InternalError(
            absl::StrCat("target ", t->address, " chose nccl, which this feed did not offer"));
      }
      absl::Status joined = peer->Wait(options.nccl_timeout_s);
      if (joined.ok()) joined = peer->Handshake(options.nccl_timeout_s);
      if (!joined.ok()) {
        conn->ctx.TryCancel();
        conn->stream->Finish();
        return absl::UnavailableError(
            absl::StrCat("target ", t->address, ": nccl setup: ", joined.message()));
      }
      // Receives are posted when the target's capture is ready, so the
      // trainer's GPU never holds one through a forward; the highest priority
      // gets the receive onto the GPU at once, beside the drafter's kernels.
      int lowest_priority = 0, highest_priority = 0;
      cudaDeviceGetStreamPriorityRange(&lowest_priority, &highest_priority);
      if (cudaError_t e = cudaStreamCreateWithPriority(&conn->cuda_stream, cudaStreamNonBlocking,
                                                       highest_priority);
          e != cudaSuccess) {
        conn->ctx.TryCancel();
        conn->stream->Finish();
        return absl::InternalError(absl::StrCat("cudaStreamCreate: ", cudaGetErrorString(e)));
      }
      conn->nccl = std::move(peer);
      transport = "nccl";
    } else if (peer != nullptr) {
      peer->Abort();  // the target chose gRPC: leave the half-made communicator
    }
#endif
    std::lock_guard<std::mutex> lock(mu);
    if (closing) {
      conn->ctx.TryCancel();
      conn->stream->Finish();
      return absl::CancelledError("feed closing");
    }
    t->info = *std::move(info);
    t->credits = std::max(1, resp.opened().max_inflight_batches());
    t->conn = conn;
    t->state = State::kLive;
    t->backoff_s = options.reconnect_backoff_min_s;
    t->stats.last_error.clear();
    t->stats.transport = transport;
    t->stats.transport_note = resp.opened().transport_note();
    Conn* c = conn.get();
    c->writer = std::thread([c] {
      NameThisThread("df-write");
      WriteLoop(c);
    });
    c->reader = std::thread([this, t, conn] {
      NameThisThread("df-read");
      ReadLoop(t, conn);
    });
#if DRAFTFEED_HAVE_NCCL
    if (c->nccl != nullptr) c->waiter = std::thread([this, t, c] {
        NameThisThread("df-nccl-recv");
        WaitLoop(t, c);
      });
#endif
    cv.notify_all();
    return absl::OkStatus();
  }

  static void WriteLoop(Conn* c) {
    std::unique_lock<std::mutex> lock(c->wmu);
    for (;;) {
      c->wcv.wait(lock, [&] { return c->wclosed || !c->wq.empty(); });
      if (c->wq.empty()) break;  // closed and drained
      grpc::ByteBuffer req = std::move(c->wq.front());
      c->wq.pop_front();
      lock.unlock();
      const bool ok = c->stream->Write(req);
      lock.lock();
      if (!ok) {
        c->wq.clear();
        return;  // the reader sees the stream end and re-sends the batches
      }
    }
    lock.unlock();
    c->stream->WritesDone();
  }

  static void StopWriter(Conn* c, bool drop_queued) {
    {
      std::lock_guard<std::mutex> lock(c->wmu);
      c->wclosed = true;
      if (drop_queued) c->wq.clear();
    }
    c->wcv.notify_all();
  }

  // ---- receiving -----------------------------------------------------------

  // One message from the target; false when the stream must end (the target
  // sent garbage, or the NCCL communicator is gone: the target is lost).
  bool Process(Target* t, Conn* conn, grpc::ByteBuffer& raw, v1::StreamResponse& resp) {
    if (!conn->uses_nccl() && ReadChunkInPlace(t, conn, raw)) return true;
    if (!ParseBuffer(raw, &resp)) return false;
#if DRAFTFEED_HAVE_NCCL
    if (conn->uses_nccl() && resp.msg_case() == v1::StreamResponse::kChunk) {
      return ReceiveNccl(t, conn, resp.chunk());
    }
#endif
    HandleResponse(t, conn, resp);
    return true;
  }

  // Messages read but not yet processed, between a connection's reader and
  // its processor. Bounded, so a slow trainer still pushes back on the target.
  class Handoff {
   public:
    explicit Handoff(size_t capacity) : capacity_(capacity) {}
    // False once the processor quit.
    bool Push(grpc::ByteBuffer&& raw) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return quit_ || q_.size() < capacity_; });
      if (quit_) return false;
      q_.push_back(std::move(raw));
      cv_.notify_all();
      return true;
    }
    // False once the reader is done and everything was taken.
    bool Pop(grpc::ByteBuffer* raw) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return ended_ || !q_.empty(); });
      if (q_.empty()) return false;
      *raw = std::move(q_.front());
      q_.pop_front();
      cv_.notify_all();
      return true;
    }
    void End() {  // the reader: no more messages
      std::lock_guard<std::mutex> lock(mu_);
      ended_ = true;
      cv_.notify_all();
    }
    void Quit() {  // the processor: take no more
      std::lock_guard<std::mutex> lock(mu_);
      quit_ = true;
      q_.clear();
      cv_.notify_all();
    }

   private:
    const size_t capacity_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<grpc::ByteBuffer> q_;
    bool ended_ = false, quit_ = false;
  };

  void ReadLoop(Target* t, std::shared_ptr<Conn> conn) {
    v1::StreamResponse resp;
    grpc::ByteBuffer raw;
    if (conn->uses_nccl() || !read_handoff) {
#if DRAFTFEED_HAVE_NCCL
      if (conn->uses_nccl()) cudaSetDevice(options.cuda_device);
#endif
      // One thread reads and processes (NCCL streams carry small messages).
      while (conn->stream->Read(&raw)) {
        if (!Process(t, conn.get(), raw, resp)) {
          conn->ctx.TryCancel();  // a target that sends garbage is treated as lost
          break;
        }
      }
    } else {
      // This thread only reads, and a second one copies (and hashes) each
      // chunk into its batch: gRPC reopens its flow-control window as each
      // message is read, so the next chunk arrives while the last is copied.
      Handoff handoff(kReadAheadMessages);
      std::thread processor([&, conn] {
        NameThisThread("df-copy");
        grpc::ByteBuffer msg;
        v1::StreamResponse parsed;
        while (handoff.Pop(&msg)) {
          if (!Process(t, conn.get(), msg, parsed)) {
            conn->ctx.TryCancel();  // a target that sends garbage is treated as lost
            handoff.Quit();
            return;
          }
        }
      });
      while (conn->stream->Read(&raw)) {
        if (!handoff.Push(std::move(raw))) break;
        raw = grpc::ByteBuffer();
      }
      handoff.End();  // the processor finishes what was read (a last BatchDone)
      processor.join();
    }
    // Finish must not race a Write: stop the writer first.
    StopWriter(conn.get(), /*drop_queued=*/true);
    if (conn->writer.joinable()) conn->writer.join();
    const grpc::Status status = conn->stream->Finish();
#if DRAFTFEED_HAVE_NCCL
    if (conn->nccl != nullptr) {
      // The stream is over: whatever was posted will never be matched.
      conn->nccl->Abort();
      {
        std::lock_guard<std::mutex> rlock(conn->rmu);
        conn->rclosed = true;
      }
      conn->rcv.notify_all();
      if (conn->waiter.joinable()) conn->waiter.join();
    }
#endif
    std::lock_guard<std::mutex> lock(mu);
    OnConnEnd(t, conn, status);
    conn->finished = true;
    dead_conns.push_back(conn);
    cv.notify_all();
  }

#if DRAFTFEED_HAVE_NCCL
  // The target announced a batch whose capture is ready and whose send is
  // waiting: post the matching receive now (for every announcement, even of
  // a batch no longer wanted, or the two sides' operation order would part).
  bool ReceiveNccl(Target* t, Conn* conn, const v1::HiddenChunk& c) {
    const int64_t stride = K() * hidden_size;
    if (c.token_offset() != 0 || c.token_count() < 1 || !c.data().empty()) {
      std::lock_guard<std::mutex> lock(mu);
      t->stats.last_error = absl::StrCat("malformed nccl announcement for batch ", c.batch_id());
      return false;
    }
    const size_t values = static_cast<size_t>(c.token_count() * stride);
    absl::Status why;
    Conn::Posted posted{c.batch_id(), c.token_count(), DeviceBufferFor(c.batch_id(), values, &why),
                        {}};
    absl::StatusOr<NcclPeer::Op> op =
        posted.buffer == nullptr
            ? absl::StatusOr<NcclPeer::Op>(why)
            : conn->nccl->PostRecv(posted.buffer.get(), values * 2, conn->cuda_stream,
                                   options.nccl_timeout_s, [this] { return closing.load(); });
    std::lock_guard<std::mutex> lock(mu);
    auto it = pending.find(c.batch_id());
    const bool ours = it != pending.end() && !it->second.complete && it->second.conn == conn;
    if (!op.ok()) {
      t->stats.last_error = absl::StrCat("nccl receive: ", op.status().message());
      if (posted.buffer == nullptr && ours) {
        // Re-sending the batch would only fail the same way: it fails, with
        // why, and the stream ends (the target's send has no match).
        Fail(c.batch_id(), it->second, op.status());
        cv.notify_all();
      }
      return false;
    }
    posted.op = *op;
    if (ours) {
      it->second.recv_pending = true;
      it->second.last_progress = Clock::now();
    }
    {
      std::lock_guard<std::mutex> rlock(conn->rmu);
      conn->posted.push_back(std::move(posted));
    }
    conn->rcv.notify_one();
    return true;
  }

  // A GPU buffer for an announced batch. When the GPU is full (the drafter
  // fills it), it waits while the trainer still holds results, up to
  // nccl_timeout_s; null, with why, when no memory came.
  std::shared_ptr<uint16_t> DeviceBufferFor(uint64_t batch_id, size_t values, absl::Status* why) {
    std::shared_ptr<uint16_t> buffer = std::reinterpret_pointer_cast<uint16_t>(device_pool->Acquire(values * 2));
    const auto give_up = Clock::now() + std::chrono::milliseconds(
                                            static_cast<int64_t>(options.nccl_timeout_s * 1000));
    while (buffer == nullptr && !closing && device_pool->live_bytes() > 0 &&
           Clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      buffer = std::reinterpret_pointer_cast<uint16_t>(device_pool->Acquire(values * 2));
    }
    if (buffer == nullptr) {
      *why = absl::ResourceExhaustedError(absl::StrCat(
          "cannot allocate ", values * 2, " bytes on cuda:", options.cuda_device,
          " to receive batch ", batch_id, " (the GPU is full; ", device_pool->live_bytes(),
          " bytes of earlier results are still held)"));
    }
    return buffer;
  }

  // Completes posted receives in order and attaches each to its batch.
  void WaitLoop(Target* t, Conn* conn) {
    cudaSetDevice(options.cuda_device);
    for (;;) {
      Conn::Posted r;
      {
        std::unique_lock<std::mutex> rlock(conn->rmu);
        conn->rcv.wait(rlock, [&] { return conn->rclosed || !conn->posted.empty(); });
        if (conn->rclosed) return;
        r = std::move(conn->posted.front());
        conn->posted.pop_front();
      }
      double recv_ms = 0;
      absl::StatusOr<uint64_t> sum = conn->nccl->WaitOp(
          r.op, options.nccl_timeout_s, [this] { return closing.load(); }, &recv_ms);
      std::lock_guard<std::mutex> lock(mu);
      if (!sum.ok()) {
        if (!closing) t->stats.last_error = absl::StrCat("nccl receive: ", sum.status().message());
        conn->ctx.TryCancel();  // the stream ends; its batches go elsewhere
        return;
      }
      stats.bytes_received += static_cast<int64_t>(r.tokens * K() * hidden_size * 2);
      auto it = pending.find(r.batch_id);
      if (it == pending.end() || it->second.complete || it->second.conn != conn) continue;
      Pending& p = it->second;
      p.recv_pending = false;
      p.last_progress = Clock::now();
      if (r.tokens != static_cast<int64_t>(p.token_ids.size())) {
        Fail(r.batch_id, p,
             absl::DataLossError(absl::StrCat("target ", t->address, " announced ", r.tokens,
                                              " tokens for batch ", r.batch_id, " of ",
                                              p.token_ids.size())));
        cv.notify_all();
        continue;
      }
      p.device = std::move(r.buffer);
      p.device_checksum = options.verify_checksum ? *sum : 0;
      p.result.recv_ms = recv_ms;
      p.tokens_received = r.tokens;
      if (p.early_done.has_value()) {
        const v1::BatchDone d = *std::move(p.early_done);
        p.early_done.reset();
        FinishBatch(t, r.batch_id, p, d);
      }
    }
  }
#endif

  void OnConnEnd(Target* t, const std::shared_ptr<Conn>& conn, const grpc::Status& status) {
    if (t->conn == conn) {
      t->conn = nullptr;
      if (t->state == State::kLive) t->state = State::kDown;
      t->next_attempt = Clock::now() + std::chrono::milliseconds(
                                           static_cast<int64_t>(t->backoff_s * 1000));
      if (!closing) {
        ++t->stats.failures;
        if (t->stats.last_error.empty()) {
          t->stats.last_error =
              status.ok() ? "stream ended"
                          : absl::StrCat(status.error_code(), ": ", status.error_message());
        }
      }
    }
    // Whatever this stream still owed goes back to the queue for another target.
    for (auto& [id, p] : pending) {
      if (p.conn == conn.get() && !p.complete) {
        Unassign(p);
        unassigned.insert(id);
        ++stats.resent;
      }
    }
  }

  void Unassign(Pending& p) {
    if (p.target != nullptr) {
      --p.target->stats.outstanding_batches;
      p.target->stats.outstanding_tokens -= static_cast<int64_t>(p.token_ids.size());
    }
    p.target = nullptr;
    p.conn = nullptr;
    p.tokens_received = 0;
    ++p.epoch;  // a reader still copying a chunk of the old assignment drops it
    p.recv_pending = false;
    p.early_done.reset();
    p.hasher.Reset();
    p.hashed_in_order = true;
  }

  void Fail(uint64_t id, Pending& p, absl::Status status) {
    Unassign(p);
    unassigned.erase(id);
    p.complete = true;
    p.error = std::move(status);
    p.hidden.reset();
    p.device.reset();
    ++stats.failed;
  }

  // The hot path: a HiddenChunk in the field order the target writes (1, 2, 3,
  // then data) is copied from the gRPC slices straight into its batch. Any
  // other message (or order) returns false and takes the protobuf path.
  bool ReadChunkInPlace(Target* t, Conn* conn, grpc::ByteBuffer& raw) {
    grpc::ProtoBufferReader reader(&raw);
    google::protobuf::io::CodedInputStream in(&reader);
    in.SetTotalBytesLimit(INT_MAX);
    uint32_t len = 0;
    uint64_t id = 0, offset = 0, count = 0;
    uint32_t data_len = 0;
    if (in.ReadTag() != 0x12 || !in.ReadVarint32(&len) || in.ReadTag() != 0x08 ||
        !in.ReadVarint64(&id) || in.ReadTag() != 0x10 || !in.ReadVarint64(&offset) ||
        in.ReadTag() != 0x18 || !in.ReadVarint64(&count) || in.ReadTag() != 0x22 ||
        !in.ReadVarint32(&data_len)) {
      return false;
    }
    // The copy and the hash run without `mu`, so the connections of one feed
    // (and its several targets) receive in parallel. The batch's buffer is
    // held by a reference of our own; `epoch` tells whether the batch was
    // re-assigned meanwhile (then this chunk is dropped).
    std::shared_ptr<uint16_t> buffer;
    uint16_t* dst = nullptr;
    v1::PayloadHasher hasher;
    bool hash = false;
    uint64_t epoch = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = pending.find(id);
      if (it == pending.end() || it->second.complete || it->second.conn != conn) return true;
      Pending& p = it->second;
      const int64_t T = static_cast<int64_t>(p.token_ids.size());
      const int64_t stride = K() * hidden_size;
      p.last_progress = Clock::now();
      if (static_cast<int64_t>(offset) + static_cast<int64_t>(count) > T ||
          static_cast<int64_t>(data_len) != static_cast<int64_t>(count) * stride * 2 ||
          p.hidden == nullptr) {
        FailMalformedChunk(t, id, p, offset, count, data_len);
        return true;
      }
      buffer = p.hidden;
      dst = p.hidden.get() + static_cast<int64_t>(offset) * stride;
      hash = options.verify_checksum && p.hashed_in_order &&
             static_cast<int64_t>(offset) == p.tokens_received;
      if (hash) hasher = p.hasher;
      epoch = p.epoch;
    }
    // The payload is copied (and hashed, in the same pass) straight from
    // gRPC's slices, past the envelope the CodedInputStream just read.
    const size_t header = static_cast<size_t>(in.CurrentPosition());
    const bool read = CopyPayload(raw, header, data_len, dst, hash ? &hasher : nullptr);
    std::lock_guard<std::mutex> lock(mu);
    auto it = pending.find(id);
    if (it == pending.end() || it->second.complete || it->second.conn != conn ||
        it->second.epoch != epoch) {
      return true;
    }
    Pending& p = it->second;
    if (!read) {
      FailMalformedChunk(t, id, p, offset, count, data_len);
      return true;
    }
    if (options.verify_checksum) {
      if (hash) {
        p.hasher = hasher;
      } else {
        p.hashed_in_order = false;
      }
    }
    p.tokens_received += static_cast<int64_t>(count);
    stats.bytes_received += data_len;
    return true;
  }

  // Copies `n` bytes starting `skip` bytes into `raw` to `dst`, hashing them
  // on the way when `hasher` is given.
  static bool CopyPayload(grpc::ByteBuffer& raw, size_t skip, size_t n, uint16_t* dst_words,
                          v1::PayloadHasher* hasher) {
    std::vector<grpc::Slice> slices;
    if (!raw.Dump(&slices).ok()) return false;
    auto* dst = reinterpret_cast<unsigned char*>(dst_words);
    for (const grpc::Slice& slice : slices) {
      if (n == 0) break;
      size_t len = slice.size();
      const unsigned char* src = slice.begin();
      if (skip >= len) {
        skip -= len;
        continue;
      }
      src += skip;
      len = std::min(len - skip, n);
      skip = 0;
      if (hasher != nullptr) {
        hasher->CopyAndUpdate(dst, src, len);
      } else {
        std::memcpy(dst, src, len);
      }
      dst += len;
      n -= len;
    }
    return n == 0;
  }

  void FailMalformedChunk(Target* t, uint64_t id, Pending& p, uint64_t offset, uint64_t count,
                          uint32_t data_len) {
    Fail(id, p,
         absl::DataLossError(absl::StrCat("target ", t->address,
                                          " sent a malformed chunk for batch ", id, ": tokens [",
                                          offset, ", +", count, ") of ", p.token_ids.size(), ", ",
                                          data_len, " bytes")));
    cv.notify_all();
  }

  void HandleResponse(Target* t, Conn* conn, v1::StreamResponse& resp) {
    std::lock_guard<std::mutex> lock(mu);
    uint64_t id = 0;
    switch (resp.msg_case()) {
      case v1::StreamResponse::kChunk: id = resp.chunk().batch_id(); break;
      case v1::StreamResponse::kDone: id = resp.done().batch_id(); break;
      case v1::StreamResponse::kError: id = resp.error().batch_id(); break;
      default: return;
    }
    auto it = pending.find(id);
    if (it == pending.end() || it->second.complete || it->second.conn != conn) {
      // A batch that was re-sent elsewhere (or already returned): drop it.
      if (resp.msg_case() == v1::StreamResponse::kDone) ++stats.duplicates_dropped;
      return;
    }
    Pending& p = it->second;
    const int64_t T = static_cast<int64_t>(p.token_ids.size());
    const int64_t stride = K() * hidden_size;
    p.last_progress = Clock::now();
    if (resp.msg_case() == v1::StreamResponse::kChunk) {
      const v1::HiddenChunk& c = resp.chunk();
      if (c.token_offset() < 0 || c.token_count() < 0 || c.token_offset() + c.token_count() > T ||
          static_cast<int64_t>(c.data().size()) != c.token_count() * stride * 2) {
        Fail(id, p,
             absl::DataLossError(absl::StrCat("target ", t->address,
                                              " sent a malformed chunk for batch ", id,
                                              ": tokens [", c.token_offset(), ", +",
                                              c.token_count(), ") of ", T, ", ",
                                              c.data().size(), " bytes")));
        cv.notify_all();
        return;
      }
      std::memcpy(p.hidden.get() + c.token_offset() * stride, c.data().data(), c.data().size());
      p.hashed_in_order = false;  // this (rare) path re-hashes the batch at the end
      p.tokens_received += c.token_count();
      stats.bytes_received += static_cast<int64_t>(c.data().size());
      return;
    }
    if (resp.msg_case() == v1::StreamResponse::kError) {
      const v1::BatchError& e = resp.error();
      const auto code = static_cast<absl::StatusCode>(e.code());
      if (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kResourceExhausted) {
        // The target is draining or full: the batch is fine, send it elsewhere.
        Unassign(p);
        unassigned.insert(id);
        ++stats.resent;
      } else {
        Fail(id, p, absl::Status(code, absl::StrCat("target ", t->address, ": ", e.message())));
      }
      cv.notify_all();
      return;
    }
    if (p.recv_pending) {
      p.early_done = resp.done();  // the NCCL receive attaches it (WaitLoop)
      return;
    }
    FinishBatch(t, id, p, resp.done());
  }

  // A batch's BatchDone with its payload in place: check it, hand it out.
  void FinishBatch(Target* t, uint64_t id, Pending& p, const v1::BatchDone& d) {
    const int64_t T = static_cast<int64_t>(p.token_ids.size());
    if (p.tokens_received != T || d.tokens() != T) {
      Fail(id, p,
           absl::DataLossError(absl::StrCat("batch ", id, " from ", t->address, ": received ",
                                            p.tokens_received, " of ", T, " tokens")));
    } else if (options.verify_checksum &&
               (p.device != nullptr ? p.device_checksum
                : p.hashed_in_order && p.hasher.bytes_seen() == p.values * 2
                    ? p.hasher.Finish()
                    : v1::PayloadChecksum(p.hidden.get(), p.values * 2)) != d.checksum()) {
      Fail(id, p,
           absl::DataLossError(
               absl::StrCat("batch ", id, " from ", t->address, ": checksum mismatch")));
    } else {
      ++t->stats.delivered_batches;
      t->stats.delivered_tokens += T;
      if (d.timings().forward_ms() > 0) {
        const double inst = static_cast<double>(T) / (d.timings().forward_ms() / 1000.0);
        t->rate_tps = t->rate_tps > 0 ? 0.7 * t->rate_tps + 0.3 * inst : inst;
      }
      Unassign(p);
      p.complete = true;
      HiddenBatch& r = p.result;
      r.batch_id = id;
      r.num_tokens = T;
      r.num_layers = K();
      r.hidden_size = hidden_size;
      r.buffer = std::move(p.hidden);
      if (p.device != nullptr) {
        r.buffer.reset();
        r.device_buffer = std::move(p.device);
        r.device = options.cuda_device;
      }
      r.num_values = p.values;
      r.token_ids = std::move(p.token_ids);
      r.seq_lens = std::move(p.seq_lens);
      r.checksum = d.checksum();
      r.target = t->address;
      r.queue_ms = d.timings().queue_ms();
      r.forward_ms = d.timings().forward_ms();
      r.send_ms = d.timings().send_ms();
    }
    cv.notify_all();
  }

  // ---- dispatch and supervision -------------------------------------------

  // Sends unassigned batches, oldest first, each to the live target that would
  // finish it soonest: (its outstanding tokens + this batch) / its measured
  // rate. When that target has no free credit the batch waits for it rather
  // than going to a slower target, so one slow target cannot hold the
  // head of an ordered feed.
  void Dispatch() {
    while (!unassigned.empty()) {
      const uint64_t id = *unassigned.begin();
      Pending& p = pending.at(id);
      const double tokens = static_cast<double>(p.token_ids.size());
      double known = 0;
      int n_known = 0;
      for (auto& t : targets) {
        if (t->state == State::kLive && t->rate_tps > 0) {
          known += t->rate_tps;
          ++n_known;
        }
      }
      const double default_rate = n_known > 0 ? known / n_known : 1.0;
      Target* best = nullptr;
      double best_eta = 0;
      for (auto& t : targets) {
        if (t->state != State::kLive) continue;
        const double rate = t->rate_tps > 0 ? t->rate_tps : default_rate;
        const double eta = (static_cast<double>(t->stats.outstanding_tokens) + tokens) / rate;
        if (best == nullptr || eta < best_eta) {
          best = t.get();
          best_eta = eta;
        }
      }
      if (best == nullptr || best->stats.outstanding_batches >= best->credits) return;
      unassigned.erase(unassigned.begin());
      p.target = best;
      p.conn = best->conn.get();
      // Host memory only for streams that deliver into it.
      p.device.reset();
      if (p.conn->uses_nccl()) {
        p.hidden.reset();
      } else if (p.hidden == nullptr) {
        p.hidden = std::reinterpret_pointer_cast<uint16_t>(pool->Acquire(p.values * 2));
      }
      p.tokens_received = 0;
      p.last_progress = Clock::now();
      ++best->stats.outstanding_batches;
      best->stats.outstanding_tokens += static_cast<int64_t>(p.token_ids.size());
      v1::StreamRequest req;
      v1::Batch* b = req.mutable_batch();
      b->set_batch_id(id);
      b->mutable_token_ids()->Add(p.token_ids.begin(), p.token_ids.end());
      b->mutable_seq_lens()->Add(p.seq_lens.begin(), p.seq_lens.end());
      {
        std::lock_guard<std::mutex> wlock(p.conn->wmu);
        p.conn->wq.push_back(ToBuffer(req));
      }
      p.conn->wcv.notify_one();
    }
  }

  bool AnyLive() const {
    for (const auto& t : targets) {
      if (t->state == State::kLive) return true;
    }
    return false;
  }

  std::string TargetErrors() const {
    std::vector<std::string> why;
    for (const auto& t : targets) {
      why.push_back(absl::StrCat(t->address, ": ",
                                 t->stats.last_error.empty() ? "no answer" : t->stats.last_error));
    }
    return absl::StrJoin(why, "; ");
  }

  void SuperviseLoop() {
    std::unique_lock<std::mutex> lock(mu);
    while (!closing) {
      const Clock::time_point now = Clock::now();
      Dispatch();
      // Hung targets: a batch without progress for batch_timeout_s.
      for (auto& [id, p] : pending) {
        if (p.complete || p.conn == nullptr) continue;
        if (now - p.last_progress > std::chrono::duration<double>(options.batch_timeout_s)) {
          Target* t = p.target;
          t->stats.last_error = absl::StrCat("no progress on batch ", id, " for ",
                                             options.batch_timeout_s, "s; treating it as hung");
          if (t->state == State::kLive) t->state = State::kDown;
          p.conn->ctx.TryCancel();  // the reader re-sends its batches
          p.last_progress = now;
        }
      }
      // No live target while work waits: fail after unavailable_timeout_s.
      const bool work_waiting = !pending.empty();
      if (AnyLive() || !work_waiting) {
        no_target_since.reset();
      } else if (!no_target_since) {
        no_target_since = now;
      } else if (fatal.ok() && now - *no_target_since >
                                   std::chrono::duration<double>(options.unavailable_timeout_s)) {
        fatal = absl::UnavailableError(absl::StrCat("no target reachable for ",
                                                    options.unavailable_timeout_s,
                                                    "s: ", TargetErrors()));
        for (auto& [id, p] : pending) {
          if (!p.complete) Fail(id, p, fatal);
        }
        cv.notify_all();
      }
      // DNS discovery.
      if (!dns_targets.empty() && now >= next_dns_refresh) {
        next_dns_refresh = now + std::chrono::milliseconds(
                                     static_cast<int64_t>(options.dns_refresh_s * 1000));
        std::vector<std::string> names = dns_targets;
        lock.unlock();
        std::vector<std::string> found;
        for (const std::string& n : names) {
          if (auto r = ExpandTarget(n); r.ok()) found.insert(found.end(), r->begin(), r->end());
        }
        lock.lock();
        for (const std::string& a : found) AddTargetLocked(a);
      }
      // Join the threads of ended streams.
      for (auto it = dead_conns.begin(); it != dead_conns.end();) {
        std::shared_ptr<Conn> c = *it;
        it = dead_conns.erase(it);
        lock.unlock();
        if (c->reader.joinable()) c->reader.join();
        lock.lock();
      }
      cv.wait_for(lock, std::chrono::milliseconds(20));
    }
  }

  absl::Status AddTargets(const std::string& target) {
    auto addresses = ExpandTarget(target);
    if (!addresses.ok()) return addresses.status();
    std::lock_guard<std::mutex> lock(mu);
    if (target.rfind("dns:///", 0) == 0) dns_targets.push_back(target);
    for (const std::string& a : *addresses) AddTargetLocked(a);
    cv.notify_all();
    return absl::OkStatus();
  }
};

Feed::Feed(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Feed::~Feed() { (void)Close(); }

absl::StatusOr<std::unique_ptr<Feed>> Feed::Open(const FeedOptions& options) {
  if (options.targets.empty()) return absl::InvalidArgumentError("FeedOptions.targets is empty");
  if (options.layers.empty()) {
    return absl::InvalidArgumentError("FeedOptions.layers is empty: name the layer ids to capture");
  }
  if (options.prefetch < 1) return absl::InvalidArgumentError("FeedOptions.prefetch must be >= 1");
  if (options.credits_per_target < 1) {
    return absl::InvalidArgumentError("FeedOptions.credits_per_target must be >= 1");
  }
  if (options.connections_per_target < 1 || options.connections_per_target > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("FeedOptions.connections_per_target must be in [1, 64], got ",
                     options.connections_per_target));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->read_handoff = options.read_handoff.value_or(std::thread::hardware_concurrency() >= 4);
  // Idle cap: the prefetch window plus one batch in the trainer's hands. A
  // batch larger than prefetch_bytes is let through alone: two such buffers
  // (the one arriving, the one in the trainer's hands) stay for reuse anyway.
  impl->pool = std::make_unique<HostBufferPool>(2 * options.prefetch_bytes, HostAllocator::Heap(),
                                                HostBufferPool::Reuse{.keep_buffers = 2});
  if (options.transport != Transport::kGrpc) {
#if DRAFTFEED_HAVE_NCCL
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
    if (options.cuda_device < 0 || options.cuda_device >= devices) {
      return absl::InvalidArgumentError(absl::StrCat(
          "transport ", options.transport == Transport::kNccl ? "nccl" : "auto",
          " needs FeedOptions.cuda_device, the GPU that receives: got ", options.cuda_device,
          "; this process sees ", devices, " CUDA device(s)"));
    }
    const int device = options.cuda_device;
    HostAllocator on_gpu;
    // Buffers are released on whichever thread drops the last reference (the
    // trainer's): leave that thread's current device as it was.
    on_gpu.allocate = [device](size_t bytes) -> void* {
      int prev = 0;
      cudaGetDevice(&prev);
      cudaSetDevice(device);
      void* p = nullptr;
      if (cudaMalloc(&p, bytes) != cudaSuccess) p = nullptr;
      cudaSetDevice(prev);
      return p;
    };
    on_gpu.release = [device](void* p) {
      int prev = 0;
      cudaGetDevice(&prev);
      cudaSetDevice(device);
      cudaFree(p);
      cudaSetDevice(prev);
    };
    // Exact sizes on the GPU, and one buffer kept, since the drafter needs
    // that memory (on a full H200, two 49,152-token results fit exactly and
    // two size classes did not); the pool drops idle buffers when an
    // allocation fails.
    impl->device_pool = std::make_unique<HostBufferPool>(
        2 * options.prefetch_bytes, on_gpu,
        HostBufferPool::Reuse{.size_classes = false, .keep_buffers = 1});
#else
    return absl::UnimplementedError(
        "this client was built without NCCL (DRAFTFEED_ENABLE_NCCL=OFF): use transport grpc");
#endif
  }
  impl->fingerprint = options.expected_fingerprint;
  if (!impl->fingerprint.empty()) impl->fingerprint_source = "FeedOptions.expected_fingerprint";
  Impl& m = *impl;
  std::unique_ptr<Feed> feed(new Feed(std::move(impl)));

  // The first target that answers fixes the model every other must match, so
  // which target is "the other model" does not depend on connection races.
  std::vector<std::string> addresses;
  for (const std::string& t : options.targets) {
    auto expanded = ExpandTarget(t);
    if (!expanded.ok()) return expanded.status();
    addresses.insert(addresses.end(), expanded->begin(), expanded->end());
  }
  if (m.fingerprint.empty()) {
    absl::Status last;
    for (const std::string& a : addresses) {
      auto stub = v1::TargetService::NewStub(MakeChannel(a));
      auto info = QueryInfo(stub.get(), a, options.connect_timeout_s, true);
      if (info.ok()) {
        m.fingerprint = info->fingerprint;
        m.fingerprint_source = absl::StrCat(a, " (", info->model_id, ")");
        m.hidden_size = info->hidden_size;
        break;
      }
      last = info.status();
    }
    if (m.fingerprint.empty()) return last;
  }
  for (const std::string& t : options.targets) {
    if (absl::Status s = m.AddTargets(t); !s.ok()) return s;
  }
  // Wait until every initial target has connected, been refused, or failed once.
  std::unique_lock<std::mutex> lock(m.mu);
  m.cv.wait(lock, [&] {
    for (const auto& t : m.targets) {
      if (t->state == Impl::State::kConnecting) return false;
    }
    return true;
  });
  for (const auto& t : m.targets) {
    if (t->state == Impl::State::kRefused) {
      const absl::Status refused = t->refusal;
      lock.unlock();
      return refused;
    }
  }
  if (!m.AnyLive()) {
    const absl::Status none =
        absl::UnavailableError(absl::StrCat("no target could be reached: ", m.TargetErrors()));
    lock.unlock();
    return none;
  }
  if (m.hidden_size == 0) {
    for (const auto& t : m.targets) {
      if (t->state == Impl::State::kLive) m.hidden_size = t->info.hidden_size;
    }
  }
  m.supervisor = std::thread([&m] {
    NameThisThread("df-supervise");
    m.SuperviseLoop();
  });
  return feed;
}

absl::Status Feed::AddTarget(const std::string& address) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->closing) return absl::FailedPreconditionError("feed is closed");
  }
  return impl_->AddTargets(address);
}

absl::StatusOr<uint64_t> Feed::Submit(std::vector<int32_t> token_ids,
                                      std::vector<int32_t> seq_lens) {
  Impl& m = *impl_;
  const int64_t bytes =
      static_cast<int64_t>(token_ids.size()) * m.K() * m.hidden_size * 2;
  std::unique_lock<std::mutex> lock(m.mu);
  m.cv.wait(lock, [&] {
    if (m.closing || !m.fatal.ok()) return true;
    if (m.stats.outstanding >= m.options.prefetch) return false;
    return m.stats.outstanding == 0 || m.outstanding_bytes + bytes <= m.options.prefetch_bytes;
  });
  if (m.closing) return absl::FailedPreconditionError("feed is closed");
  if (!m.fatal.ok()) return m.fatal;
  const uint64_t id = m.next_id++;
  Impl::Pending& p = m.pending[id];
  // Pooled and uninitialised: every value is overwritten by a chunk before
  // the batch completes (tokens_received must reach T).
  p.values = static_cast<size_t>(bytes / 2);
  p.hasher.Reset();
  p.token_ids = std::move(token_ids);
  p.seq_lens = std::move(seq_lens);
  m.unassigned.insert(id);
  m.outstanding_bytes += bytes;
  ++m.stats.submitted;
  ++m.stats.outstanding;
  m.Dispatch();
  return id;
}

absl::StatusOr<HiddenBatch> Feed::Next() {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu);
  if (m.pending.empty()) {
    return absl::FailedPreconditionError("Next() with no batch outstanding: Submit first");
  }
  std::map<uint64_t, Impl::Pending>::iterator it;
  m.cv.wait(lock, [&] {
    if (m.options.ordered) {
      it = m.pending.begin();
      return it->second.complete;
    }
    for (it = m.pending.begin(); it != m.pending.end(); ++it) {
      if (it->second.complete) return true;
    }
    return false;
  });
  Impl::Pending p = std::move(it->second);
  m.pending.erase(it);
  --m.stats.outstanding;
  m.outstanding_bytes -=
      static_cast<int64_t>(p.error.ok() ? p.result.token_ids.size() : p.token_ids.size()) *
      m.K() * m.hidden_size * 2;
  m.cv.notify_all();
  if (!p.error.ok()) return p.error;
  ++m.stats.delivered;
  m.stats.tokens_delivered += p.result.num_tokens;
  return std::move(p.result);
}

absl::Status Feed::Close() {
  Impl& m = *impl_;
  std::vector<std::shared_ptr<Impl::Conn>> conns;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.closing) return absl::OkStatus();
    m.closing = true;
    for (auto& t : m.targets) {
      if (t->conn) conns.push_back(t->conn);
    }
  }
  m.cv.notify_all();
  if (m.supervisor.joinable()) m.supervisor.join();
  // Half-close every stream: targets finish what they hold, then end it.
  for (auto& c : conns) Impl::StopWriter(c.get(), /*drop_queued=*/false);
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(m.options.batch_timeout_s));
  {
    std::unique_lock<std::mutex> lock(m.mu);
    m.cv.wait_until(lock, deadline, [&] {
      for (auto& c : conns) {
        if (!c->finished) return false;
      }
      return true;
    });
    for (auto& c : conns) {
      if (!c->finished) c->ctx.TryCancel();
    }
  }
  for (auto& t : m.targets) {
    if (t->connector.joinable()) t->connector.join();
  }
  std::vector<std::shared_ptr<Impl::Conn>> dead;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    dead.swap(m.dead_conns);
  }
  for (auto& c : conns) {
    if (c->reader.joinable()) c->reader.join();
  }
  for (auto& c : dead) {
    if (c->reader.joinable()) c->reader.join();
  }
  return absl::OkStatus();
}

const TargetDescription& Feed::target() const {
  for (const auto& t : impl_->targets) {
    if (!t->info.fingerprint.empty()) return t->info;
  }
  return impl_->targets.front()->info;
}

FeedStats Feed::Stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  FeedStats s = impl_->stats;
  s.elapsed_s = std::chrono::duration<double>(Clock::now() - impl_->opened_at).count();
  s.outstanding_bytes = impl_->outstanding_bytes;
  s.waiting_dispatch = static_cast<int64_t>(impl_->unassigned.size());
  s.buffer_allocations = impl_->pool->allocations() +
                         (impl_->device_pool != nullptr ? impl_->device_pool->allocations() : 0);
  for (const auto& t : impl_->targets) {
    TargetStats ts = t->stats;
    switch (t->state) {
      case Impl::State::kConnecting: ts.state = "connecting"; break;
      case Impl::State::kLive: ts.state = "live"; ++s.live_targets; break;
      case Impl::State::kDown: ts.state = "down"; break;
      case Impl::State::kRefused: ts.state = "refused"; break;
    }
    s.targets.push_back(std::move(ts));
  }
  return s;
}

}  // namespace draftfeed
