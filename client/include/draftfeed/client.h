// draftfeed client: feeds packed token batches to target servers and hands
// back their hidden states, token-major [T, K, H]: bf16, or fp8_e4m3 with one
// fp32 scale per token and layer (FeedOptions::encoding), which the gRPC path
// dequantizes to bf16 on the way in unless FeedOptions::fp8_raw.
//
//   draftfeed::FeedOptions opt;
//   opt.targets = {"127.0.0.1:50051"};
//   opt.layers = {1, 3, -1};            // layer ids; -1 = post-final-norm state
//   auto feed = draftfeed::Feed::Open(opt).value();
//   uint64_t id = feed->Submit(tokens, seq_lens).value();
//   draftfeed::HiddenBatch b = feed->Next().value();   // submission order
//
// Failures: a batch whose target dies, hangs or shuts down is re-sent to
// another target; a late duplicate is dropped by batch id, so every batch is
// returned exactly once. Lost targets are retried with backoff and rejoin.
//
// Thread safety: Submit and Next may be called from different threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace draftfeed {

enum class Transport {
  kGrpc,  // payload in gRPC messages, into host memory
  kNccl,  // payload by NCCL straight into `cuda_device`'s memory (another GPU, any host)
  kAuto,  // NCCL with targets where it works, gRPC with the others (each says why)
};

// How a capture's bytes encode its [T, K, H] values (the wire's numbers;
// mirrored here so that this header stands alone).
enum class Encoding : uint8_t {
  kBf16 = 1,  // 2 bytes per value: bf16 bit patterns, little endian
  // K*H + 4K bytes per token: the K layers' H values as OCP e4m3 codes
  // (layer-major), then K little-endian fp32 scales; a value is code * scale.
  // The scale of a (token, layer) row is max|x| / 448 (1 for an all-zero row).
  kFp8E4m3 = 2,
};

inline constexpr std::string_view EncodingName(Encoding e) {
  switch (e) {
    case Encoding::kBf16:
      return "bf16";
    case Encoding::kFp8E4m3:
      return "fp8_e4m3";
  }
  return "unknown";
}

// What a feed asks of the targets' lm_head, per token, beside the hidden
// states (EAGLE-3's training target). Computed on the target from fp32 logits
// of the post-final-norm state; ties go to the lowest id.
struct TargetOutputOptions {
  bool argmax = false;  // the full-vocabulary argmax (int32)
  int32_t top_k = 0;    // top-k ids and log-probs over the full vocabulary; 0: none, <= 256
  // Target token ids (<= 65,536, distinct, any order): the softmax of the
  // logits at these ids, columns in this order. Empty: none.
  std::vector<int32_t> draft_vocab;
  // kBf16, or kFp8E4m3 (one fp32 scale per token: p = code * scale).
  Encoding probs_encoding = Encoding::kBf16;
  bool empty() const { return !argmax && top_k == 0 && draft_vocab.empty(); }
};

// Where a token's target outputs sit in its row: byte offsets from the start
// of the row (-1: not asked). The wire's layout (draftfeed.proto's
// TargetOutputs), mirrored so that this header stands alone.
struct TargetOutputOffsets {
  int64_t argmax = -1;          // int32
  int64_t top_k_ids = -1;       // int32 [top_k], best first
  int64_t top_k_logprobs = -1;  // fp32 [top_k]
  int64_t probs_scale = -1;     // fp32 (fp8_e4m3 probs)
  int64_t probs = -1;           // bf16 [num_draft], or e4m3 [num_draft]
  int32_t top_k = 0;
  int64_t num_draft = 0;
  Encoding probs_encoding = Encoding::kBf16;
};

// TLS to targets started with --tls_cert. Any field set turns TLS on.
struct TlsOptions {
  // TLS with the system's trust store when no `ca_file` is given.
  bool enabled = false;
  // PEM CA certificate(s) a target's certificate must chain to.
  std::string ca_file;
  // Mutual TLS (a target started with --tls_client_ca): this client's PEM
  // certificate chain and its private key.
  std::string cert_file;
  std::string key_file;
  // The name a target's certificate must carry when it is not the host of
  // the address (connecting by IP to a certificate for a name). A
  // "dns:///name:port" target's addresses are checked against `name`.
  std::string server_name;
};

struct FeedOptions {
  // "host:port" or any gRPC target string (e.g. "dns:///targets.ns.svc:50051").
  std::vector<std::string> targets;
  // Layer ids to capture, in output order: i = raw output of decoder layer i
  // (transformers' hidden_states[i+1]), -1 = post-final-norm state. May be
  // empty when target_outputs asks for something.
  std::vector<int32_t> layers;
  // Per-token outputs of the targets' lm_head (HiddenBatch::argmax, ...);
  // a target without lm_head refuses the stream (FAILED_PRECONDITION).
  TargetOutputOptions target_outputs;
  // Batches submitted but not yet returned by Next(); Submit blocks beyond it.
  int32_t prefetch = 8;
  // The same bound in hidden-state bytes (T * bytes per token); a single batch
  // larger than this is still accepted when nothing else is outstanding.
  int64_t prefetch_bytes = int64_t{1} << 30;
  // true: Next() returns batches in submission order; false: as they complete.
  bool ordered = true;
  // Credits asked of each target (its in-flight batches for this stream).
  int32_t credits_per_target = 4;
  // Streams (each on its own TCP connection, with its own credits) per
  // target address; more than one spreads gRPC's per-connection work over
  // cores when one target's output outruns one connection.
  int32_t connections_per_target = 1;
  // Refuse targets whose fingerprint differs. Empty: the first target's is
  // taken and every other target must match it.
  std::string expected_fingerprint;
  // Recompute each batch's checksum and fail the batch on a mismatch.
  bool verify_checksum = true;
  // What the targets send. kFp8E4m3 takes K*H + 4K bytes a token instead of
  // bf16's 2*K*H. Results that come by gRPC are then dequantized to bf16 as
  // Next() hands them out (bf16(float(code) * scale), HiddenBatch::encoding
  // kBf16) unless `fp8_raw`; results that come by NCCL stay fp8_e4m3 in the
  // GPU's memory (dequantize them there: the Python client does, with torch).
  // prefetch_bytes counts the bytes sent.
  Encoding encoding = Encoding::kBf16;
  // kFp8E4m3 only: hand out the e4m3 codes and scales as they were sent
  // (HiddenBatch::encoding kFp8E4m3; fp8_codes / fp8_scale read them).
  bool fp8_raw = false;
  // Each gRPC connection reads on one thread and copies (and hashes) chunks
  // into their batches on a second, so the next chunk is already arriving
  // while the last is copied: 63% -> 83-90% of raw TCP for one connection on
  // a 32-core host, but slower where the two threads share two cores.
  // Unset: on where the machine has at least 4 cores.
  std::optional<bool> read_handoff;
  // Seconds to wait for a target to answer GetTargetInfo / Open.
  double connect_timeout_s = 30.0;
  // A batch with no progress (no chunk), on a stream with none either (a
  // batch queued behind a long one is waiting), for this long marks its
  // target hung: the stream is cancelled and its batches go to other targets.
  double batch_timeout_s = 120.0;
  // With work outstanding and no live target for this long, every waiting
  // call fails with UNAVAILABLE instead of hanging.
  double unavailable_timeout_s = 60.0;
  // Reconnect attempts to a lost target back off between these bounds.
  double reconnect_backoff_min_s = 0.2;
  double reconnect_backoff_max_s = 5.0;
  // "dns:///name:port" targets are re-resolved this often; new addresses join.
  double dns_refresh_s = 10.0;
  // The recent window of FeedStats' and TargetStats' window_* rates, seconds.
  double stats_window_s = 30.0;
  std::string client_name;
  // kNccl / kAuto need the GPU that receives (`cuda_device`); results then
  // live in its memory (HiddenBatch::device_buffer) instead of host memory.
  Transport transport = Transport::kGrpc;
  int cuda_device = -1;
  // Each batch's NCCL receive must finish in this.
  double nccl_timeout_s = 120.0;
  // A stream's NCCL set-up with its target (joining the communicator, the
  // handshake) must finish in this; across hosts a blocked port or a wrong
  // interface shows here.
  double nccl_setup_timeout_s = 60.0;
  // kAuto: NCCL with targets on other hosts too (NCCL's network transport:
  // InfiniBand/RoCE, else sockets), not only with those on this host; kNccl
  // crosses hosts unasked. A target started with --nccl_across_hosts=false
  // refuses it either way.
  bool nccl_across_hosts = false;
  // The network interface(s) NCCL uses to reach targets on other hosts
  // (NCCL_SOCKET_IFNAME's syntax: "eth0", "^docker,lo"); empty: NCCL's own
  // choice. Process-wide (NCCL reads it once): set it before the process's
  // first NCCL feed; a different value than the environment's is refused.
  std::string nccl_socket_ifname;
  TlsOptions tls;
  // Bearer token (the targets' --auth_tokens_file), sent on every call as
  // "authorization: Bearer <token>". Over plaintext it crosses the network
  // readable: use TLS beyond loopback.
  std::string token;
};

struct TargetDescription {
  std::string address;
  std::string model_id;
  std::string architecture;
  std::string fingerprint;
  std::string server_version;
  int32_t num_layers = 0;
  int32_t hidden_size = 0;
  int32_t vocab_size = 0;
  int64_t max_batch_tokens = 0;     // tokens of one forward
  // Most tokens one batch may hold (the longest sequence): a batch over
  // max_batch_tokens runs in forward chunks. A target from before chunked
  // prefill reports 0, read here as max_batch_tokens.
  int64_t max_sequence_tokens = 0;
  // A sequence's rows are the same bits whatever it is packed with, on every
  // run of the target (so a batch re-sent elsewhere after a failure returns
  // the same bits from a target of the same model and engine kind).
  bool batch_invariant = false;
  // What the bits follow beyond the model (TargetInfo.numerics): targets with
  // equal fingerprints and numerics compute the same bits.
  std::string numerics;
  std::vector<std::string> devices;
  std::vector<std::string> layer_types;
  std::string dtype;                    // of the hidden states it computes ("bf16")
  std::vector<std::string> transports;  // offered: "grpc", "nccl"
  std::vector<std::string> encodings;   // offered: "bf16", "fp8_e4m3"
  bool nccl_across_hosts = false;       // offers NCCL to trainers on other hosts too
  int32_t max_credits = 0;              // most in-flight batches a stream may have
  int32_t max_capture_layers = 0;       // most layer ids a stream may capture; 0 = no limit
  // What TargetOutputOptions it serves; all zero / empty when it has no lm_head.
  struct OutputsOffer {
    int32_t max_top_k = 0;
    int32_t max_draft_vocab = 0;
    std::vector<std::string> draft_probs_encodings;  // "bf16", "fp8_e4m3"
  } target_outputs;
  // How one model instance is held (the first engine's; replicas alike).
  struct Layout {
    int32_t tp = 1;                 // ranks holding one instance (1: one device holds it)
    std::string moe_parallel;       // MoE at tp > 1: "ep" or "split"; else empty
    int64_t rank_weight_bytes = 0;  // decoder weight bytes one rank holds
  } layout;
};

struct HiddenBatch {
  uint64_t batch_id = 0;
  std::vector<int32_t> token_ids;
  std::vector<int32_t> seq_lens;
  int64_t num_tokens = 0;
  int64_t num_layers = 0;   // K
  int64_t hidden_size = 0;  // H
  // The capture: [T, K, H] in `encoding`, `bytes_per_token` bytes a token
  // (num_bytes = T * bytes_per_token), in a buffer from the feed's pool: it
  // goes back there when the last copy of `buffer` is released. `device` -1:
  // host memory; else the CUDA device whose memory holds it (NCCL transport).
  Encoding encoding = Encoding::kBf16;
  int64_t bytes_per_token = 0;
  std::shared_ptr<std::byte> buffer;
  size_t num_bytes = 0;
  int device = -1;
  // The bytes of a result in host memory (empty for one on a GPU).
  std::span<const std::byte> bytes() const {
    return device < 0 && buffer ? std::span<const std::byte>(buffer.get(), num_bytes)
                                : std::span<const std::byte>();
  }
  // The bf16 bit patterns of a bf16 result in host memory (else empty).
  std::span<const uint16_t> bf16() const {
    if (encoding != Encoding::kBf16) return {};
    const std::span<const std::byte> b = bytes();
    return {reinterpret_cast<const uint16_t*>(b.data()), b.size() / 2};
  }
  // An fp8_e4m3 result in host memory: the H codes of token t, layer k, and
  // their scale (value = E4M3 code * scale). Empty / NaN for other results.
  std::span<const uint8_t> fp8_codes(int64_t t, int64_t k) const {
    const std::span<const std::byte> b = bytes();
    if (encoding != Encoding::kFp8E4m3 || b.empty()) return {};
    return {reinterpret_cast<const uint8_t*>(b.data() + t * bytes_per_token + k * hidden_size),
            static_cast<size_t>(hidden_size)};
  }
  float fp8_scale(int64_t t, int64_t k) const {
    const std::span<const std::byte> b = bytes();
    float s = std::numeric_limits<float>::quiet_NaN();
    if (encoding == Encoding::kFp8E4m3 && !b.empty()) {
      std::memcpy(&s, b.data() + t * bytes_per_token + num_layers * hidden_size + 4 * k, 4);
    }
    return s;
  }
  // Target outputs (FeedOptions::target_outputs), in each token's row after
  // its hidden states; `outputs` says where (offsets from the row's start).
  TargetOutputOffsets outputs;
  // Token t's full-vocabulary argmax (host results that asked for it; else -1).
  int32_t argmax(int64_t t) const {
    int32_t v = -1;
    if (outputs.argmax >= 0 && !bytes().empty()) {
      std::memcpy(&v, bytes().data() + t * bytes_per_token + outputs.argmax, 4);
    }
    return v;
  }
  // Token t's top-k ids and log-probs into `ids` and `logprobs` (top_k each).
  void top_k(int64_t t, std::span<int32_t> ids, std::span<float> logprobs) const {
    if (outputs.top_k_ids < 0 || bytes().empty()) return;
    const std::byte* row = bytes().data() + t * bytes_per_token;
    const auto k = static_cast<size_t>(outputs.top_k);
    std::memcpy(ids.data(), row + outputs.top_k_ids, 4 * std::min(k, ids.size()));
    std::memcpy(logprobs.data(), row + outputs.top_k_logprobs, 4 * std::min(k, logprobs.size()));
  }
  // Token t's draft-vocabulary probabilities widened to fp32 into `probs`
  // (num_draft values; bf16 exactly, e4m3 as code * scale).
  void draft_probs(int64_t t, std::span<float> probs) const;
  // As sent in BatchDone (verified when asked): of the bytes sent, so of the
  // fp8_e4m3 payload for a result dequantized on the way in.
  uint64_t checksum = 0;
  std::string target;  // address that computed it
  double queue_ms = 0, forward_ms = 0, send_ms = 0;
  // NCCL transport: the receive's time on the receiving GPU, from its post to
  // its end. The target's send is already waiting when the receive is
  // posted, so this is the transfer itself (send_ms adds the announcement's
  // round trip). 0 over gRPC.
  double recv_ms = 0;
};

struct TargetStats {
  std::string address;
  std::string state;  // "connecting", "live", "down" (retrying), "refused" (other model)
  int64_t outstanding_batches = 0;
  int64_t outstanding_tokens = 0;
  int64_t delivered_batches = 0;
  int64_t delivered_tokens = 0;
  int64_t failures = 0;  // streams lost (crash, hang, shutdown)
  std::string last_error;
  std::string transport;  // of the live stream: "grpc" or "nccl"
  // Why not NCCL, when auto chose gRPC; for NCCL across hosts, which hosts.
  std::string transport_note;
  // delivered_batches and delivered_tokens per second since the target joined
  // the feed (Open or AddTarget), and over the recent window as FeedStats'.
  double batches_per_s = 0;
  double tokens_per_s = 0;
  double window_s = 0;
  double window_batches_per_s = 0;
  double window_tokens_per_s = 0;
};

struct FeedStats {
  int64_t submitted = 0;
  int64_t delivered = 0;
  int64_t failed = 0;              // batches returned as errors
  int64_t resent = 0;              // batches re-sent after a target was lost
  int64_t duplicates_dropped = 0;  // late results of re-sent batches
  int64_t cancelled = 0;           // batches dropped by Cancel (or Close) before Next took them
  int64_t tokens_delivered = 0;
  int64_t bytes_received = 0;
  // Result buffers allocated fresh (host and GPU pools together). The pools
  // keep what two batches need (or 2 x prefetch_bytes, if more), so steady
  // streaming adds none: no page faults, no cudaMalloc/cudaFree per batch.
  int64_t buffer_allocations = 0;
  int64_t outstanding = 0;  // submitted, not yet returned by Next()
  int64_t outstanding_bytes = 0;
  int64_t waiting_dispatch = 0;  // outstanding batches not on any target now
  int64_t live_targets = 0;
  double elapsed_s = 0;  // since Open
  // Per second since Open: `delivered` and `tokens_delivered` (batches and
  // tokens Next() returned) and `bytes_received` (what the transports carried,
  // duplicates included).
  double batches_per_s = 0;
  double tokens_per_s = 0;
  double bytes_per_s = 0;
  // The same over the last FeedOptions::stats_window_s seconds: the increase
  // since a sample of the counters taken at or just before the window's start
  // (samples are 1/64 of the window apart), over `window_s`, the seconds that
  // spans (less while the feed is younger than the window).
  double window_s = 0;
  double window_batches_per_s = 0;
  double window_tokens_per_s = 0;
  double window_bytes_per_s = 0;
  // After Close(): Stats() returns the numbers Close() left, frozen.
  bool closed = false;
  std::vector<TargetStats> targets;
};

// Queries one target without opening a stream (plaintext, no token; or with
// FeedOptions' `tls` and `token`).
absl::StatusOr<TargetDescription> DescribeTarget(const std::string& address,
                                                 double timeout_s = 10.0);
absl::StatusOr<TargetDescription> DescribeTarget(const std::string& address, const TlsOptions& tls,
                                                 const std::string& token, double timeout_s = 10.0);

class Feed {
 public:
  static absl::StatusOr<std::unique_ptr<Feed>> Open(const FeedOptions& options);
  ~Feed();
  Feed(const Feed&) = delete;
  Feed& operator=(const Feed&) = delete;

  // Queues a packed batch; blocks while `prefetch` batches are outstanding.
  // Returns the batch id that the matching HiddenBatch carries.
  absl::StatusOr<uint64_t> Submit(std::vector<int32_t> token_ids, std::vector<int32_t> seq_lens);
  // Next result in submission order; blocks until it is ready. A batch the
  // target refused comes back as that error (the feed stays usable).
  // FAILED_PRECONDITION when nothing is outstanding.
  absl::StatusOr<HiddenBatch> Next();
  // Adds a target to the running feed (same model required); it gets work
  // as soon as it is connected. "dns:///name:port" adds every address.
  absl::Status AddTarget(const std::string& address);
  // Drops the outstanding batches named (none named: every one), so Next()
  // never returns them; returns how many. Those still on a target are not
  // computed: each stream holding one is cancelled (the target skips the
  // batches it has not started) and reconnects at once; other batches it held
  // go to the queue again. For a loop left early (Python: `break`).
  int64_t Cancel(const std::vector<uint64_t>& batch_ids = {});
  // Cancels what is outstanding, half-closes the streams and waits for them
  // to end. Stats() then returns the final numbers (FeedStats::closed).
  absl::Status Close();

  const TargetDescription& target() const;  // the first target's description
  FeedStats Stats() const;

 private:
  struct Impl;
  explicit Feed(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace draftfeed
