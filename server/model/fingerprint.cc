// Model fingerprint: a 128-bit digest, stable across runs, builds and hosts,
// of everything that decides the hidden states:
//  - the architecture and each config field the maths reads (not the naming
//    layout, so a checkpoint saved with either prefix fingerprints the same);
//  - for every decoder tensor, in the canonical order of weight_layout.h: its
//    name, dtype, shape and bytes. The bytes are hashed whole when the decoder
//    is under 64 MiB, else as 16 evenly spaced 4 KiB windows per tensor, so a
//    54 GB checkpoint costs ~54 MB of reads (their readahead is asked for all
//    at once, so that a cold page cache serves them in parallel).
//  - for an FP8 tensor, its block scales too (dtype, shape, bytes), and the
//    config's quantization scheme.
// The raw bytes and the dtype are hashed, so the same values stored as bf16
// and as f32 fingerprint differently; that is deliberate, since a bf16 and an
// f32 copy need not give bit-identical states.
#include <sys/mman.h>
#include <unistd.h>

#include <bit>
#include <cstring>

#include "absl/strings/str_format.h"
#include "server/model/model.h"
#include "server/model/weight_layout.h"

namespace draftfeed {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the digest reads words little-endian; add a byte swap for this host");

constexpr uint64_t kWholeHashLimit = 64ull << 20;
constexpr uint64_t kSampleWindows = 16;
constexpr uint64_t kSampleWindowBytes = 4096;

uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

uint64_t Avalanche(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

// Two 64-bit lanes, each word multiplied, rotated and folded in (the body of
// MurmurHash3's 128-bit variant, over a stream rather than one buffer).
class Digest {
 public:
  void Bytes(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t w;
      std::memcpy(&w, b + i, 8);
      Word(w);
    }
    uint64_t tail = 0;
    for (size_t k = 0; i + k < n; ++k) tail |= static_cast<uint64_t>(b[i + k]) << (8 * k);
    Word(tail ^ (static_cast<uint64_t>(n - i) << 56));
    length_ += n;
  }
  void U64(uint64_t v) { Word(v); }
  void F64(double v) { Word(std::bit_cast<uint64_t>(v)); }
  void Str(std::string_view s) {
    U64(s.size());
    Bytes(s.data(), s.size());
  }

  std::string Hex() const {
    uint64_t a = h1_ ^ length_, b = h2_ ^ length_;
    a += b;
    b += a;
    a = Avalanche(a);
    b = Avalanche(b);
    a += b;
    b += a;
    return absl::StrFormat("%016x%016x", a, b);
  }

 private:
  void Word(uint64_t w) {
    uint64_t k1 = w * 0x87c37b91114253d5ull;
    k1 = Rotl(k1, 31) * 0x4cf5ad432745937full;
    h1_ ^= k1;
    h1_ = Rotl(h1_, 27) + h2_;
    h1_ = h1_ * 5 + 0x52dce729;
    uint64_t k2 = (w ^ 0x9e3779b97f4a7c15ull) * 0x4cf5ad432745937full;
    k2 = Rotl(k2, 33) * 0x87c37b91114253d5ull;
    h2_ ^= k2;
    h2_ = Rotl(h2_, 31) + h1_;
    h2_ = h2_ * 5 + 0x38495ab5;
  }

  uint64_t h1_ = 0x6a09e667f3bcc908ull;
  uint64_t h2_ = 0xbb67ae8584caa73bull;
  uint64_t length_ = 0;
};

// Where sample window i of a tensor of n bytes starts (n > the windows' total).
uint64_t WindowOffset(uint64_t n, uint64_t i) {
  return (n - kSampleWindowBytes) * i / (kSampleWindows - 1);
}

void HashTensor(Digest& d, std::string_view name, const Tensor& t, bool whole) {
  d.Str(name);
  if (!t.valid()) {
    d.Str("absent");
    return;
  }
  d.Str(DTypeName(t.dtype));
  d.U64(t.shape.size());
  for (int64_t dim : t.shape) d.U64(static_cast<uint64_t>(dim));
  const uint64_t n = t.nbytes();
  d.U64(n);
  if (whole || n <= kSampleWindows * kSampleWindowBytes) {
    d.Bytes(t.data, n);
    return;
  }
  for (uint64_t i = 0; i < kSampleWindows; ++i)
    d.Bytes(t.data + WindowOffset(n, i), kSampleWindowBytes);
}

// Asks the kernel to start reading every window HashTensor will sample. From
// a cold page cache the windows of a large checkpoint are thousands of small
// reads scattered over every shard; faulted in one by one they cost one disk
// round trip each (seconds on a network disk), queued at once they overlap.
// MADV_WILLNEED on a file mapping only schedules readahead, and on any other
// memory it does nothing harmful.
void PrefetchWindows(const Tensor& t) {
  if (!t.valid() || t.nbytes() <= kSampleWindows * kSampleWindowBytes) return;
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  for (uint64_t i = 0; i < kSampleWindows; ++i) {
    const auto begin = reinterpret_cast<uintptr_t>(t.data + WindowOffset(t.nbytes(), i));
    const uintptr_t first = begin & ~(page - 1);
    (void)madvise(reinterpret_cast<void*>(first), begin + kSampleWindowBytes - first,
                  MADV_WILLNEED);
  }
}

// An FP8 weight's values are its bytes times its scales: the scales are
// hashed whole (1/16384 of the weight's bytes). Hashed only for FP8 tensors,
// so every other model's fingerprint stays what it was.
void HashTensorAndScales(Digest& d, std::string_view name, const Tensor& t, bool whole) {
  HashTensor(d, name, t, whole);
  if (!t.valid() || !t.fp8()) return;
  const BlockScales& s = t.scale_inv;
  d.Str("scale_inv");
  d.Str(DTypeName(s.dtype));
  d.U64(s.shape.size());
  for (int64_t dim : s.shape) d.U64(static_cast<uint64_t>(dim));
  if (s.valid()) d.Bytes(s.data, s.nbytes());
}

}  // namespace

std::string ComputeFingerprint(const Model& model) {
  const ModelConfig& c = model.config;
  Digest d;
  d.Str("draftfeed-fingerprint-v1");
  d.Str(ArchName(c.arch));  // stands for c.features too: FeaturesOf(arch) fixes them
  for (int64_t v : {c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
                    c.num_kv_heads, c.head_dim, c.rotary_dim()}) {
    d.U64(static_cast<uint64_t>(v));
  }
  d.F64(c.rms_norm_eps);
  d.F64(c.rope_theta);
  d.F64(c.partial_rotary_factor);
  d.U64(c.tie_word_embeddings ? 1 : 0);
  if (c.features.linear_attention) {  // the GDN fields mean nothing to a dense model
    for (int64_t v : {c.linear_conv_kernel, c.linear_key_head_dim, c.linear_value_head_dim,
                      c.linear_num_key_heads, c.linear_num_value_heads}) {
      d.U64(static_cast<uint64_t>(v));
    }
  }
  d.U64(c.layer_types.size());
  for (LayerKind k : c.layer_types) d.U64(static_cast<uint64_t>(k));
  if (c.features.mlp != MlpKind::kDenseSwiGlu) {  // hashed only where they mean something
    for (int64_t v : {c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                      c.shared_expert_intermediate_size, c.decoder_sparse_step}) {
      d.U64(static_cast<uint64_t>(v));
    }
    d.U64(c.norm_topk_prob ? 1 : 0);
    d.U64(c.mlp_only_layers.size());
    for (int64_t l : c.mlp_only_layers) d.U64(static_cast<uint64_t>(l));
  }
  if (c.quantization.enabled) {  // absent for unquantized models, whose digests predate it
    // modules_to_not_convert is not hashed: the tensors' dtypes decide what is FP8.
    d.Str("fp8-e4m3-dynamic");
    d.U64(static_cast<uint64_t>(c.quantization.block_rows));
    d.U64(static_cast<uint64_t>(c.quantization.block_cols));
  }
  if (model.weights_on_device_random) {
    // Weights made on the GPU from a seed: the seed stands for their bytes.
    d.Str("device-random");
    d.U64(model.device_random_seed);
    return d.Hex();
  }

  std::vector<WeightSpec> specs;
  if (c.layer_types.size() == static_cast<size_t>(c.num_layers)) specs = DecoderWeightSpecs(c);
  // A tied head is embed_tokens again, already hashed.
  if (!c.tie_word_embeddings) specs.push_back(LmHeadSpec(c));

  auto slot = [&](const WeightSpec& s) -> const Tensor* {
    if (s.layer >= 0 && static_cast<size_t>(s.layer) >= model.weights.layers.size()) {
      return nullptr;
    }
    return &WeightSlot(model.weights, s);
  };
  uint64_t total = 0;
  for (const WeightSpec& s : specs) {
    const Tensor* t = slot(s);
    if (t != nullptr && t->valid()) total += t->nbytes();
  }
  const bool whole = total < kWholeHashLimit;
  d.U64(whole ? 1 : 0);
  const Tensor absent;
  if (!whole) {
    for (const WeightSpec& s : specs) {
      if (const Tensor* t = slot(s); t != nullptr) PrefetchWindows(*t);
    }
  }
  for (const WeightSpec& s : specs) {
    const Tensor* t = slot(s);
    HashTensorAndScales(d, s.name, t != nullptr ? *t : absent, whole);
  }
  return d.Hex();
}

}  // namespace draftfeed
