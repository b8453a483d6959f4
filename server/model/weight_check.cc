#include "server/model/weight_check.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/fp8_e4m3.h"
#include "server/model/weight_layout.h"

namespace draftfeed {
namespace {

constexpr char kFix[] =
    "the checkpoint is corrupt: download or convert it again (--check_weights=false starts "
    "without this check, serving whatever these weights compute)";

// One tensor's bytes to scan: its values, or an FP8 weight's block scales.
struct Region {
  const WeightSpec* spec;
  bool scales;
  DType dtype;
  const std::vector<int64_t>* shape;
  const std::byte* data;
  int64_t numel;
};

// A piece of one region, the unit a thread takes. About 8 MiB: large enough
// that taking one costs nothing beside scanning it, small enough that the
// threads finish together and that a bad value early on stops the rest soon.
struct Chunk {
  int32_t region;
  int64_t begin, end;  // elements
};
constexpr int64_t kChunkBytes = int64_t{8} << 20;

// Index of the first element in [begin, end) whose `mask` bits are all ones,
// or -1. For bf16, fp16 and fp32 the mask is the exponent (all ones: NaN or
// infinity); for e4m3, which has no infinities, it is everything but the sign
// (0x7f and 0xff are its NaNs). Blocks of plain integer compares OR-ed
// together, which the compiler vectorises (memcpy: the data may be
// unaligned); only a block with a hit is scanned again for its index.
template <typename Bits>
int64_t FirstAllOnes(const std::byte* data, int64_t begin, int64_t end, Bits mask) {
  constexpr int64_t kBlock = 4096;
  for (int64_t start = begin; start < end; start += kBlock) {
    const int64_t stop = std::min(end, start + kBlock);
    Bits any = 0;
    for (int64_t i = start; i < stop; ++i) {
      Bits v;
      std::memcpy(&v, data + i * static_cast<int64_t>(sizeof(Bits)), sizeof(Bits));
      any |= static_cast<Bits>((v & mask) == mask);
    }
    if (any == 0) continue;
    for (int64_t i = start; i < stop; ++i) {
      Bits v;
      std::memcpy(&v, data + i * static_cast<int64_t>(sizeof(Bits)), sizeof(Bits));
      if ((v & mask) == mask) return i;
    }
  }
  return -1;
}

float ElementAsFloat(DType dtype, const std::byte* data, int64_t i) {
  if (dtype == DType::kF8E4M3) return E4m3ToFloat(static_cast<uint8_t>(data[i]));
  if (dtype == DType::kF32) {
    float f;
    std::memcpy(&f, data + i * 4, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, data + i * 2, 2);
  return dtype == DType::kBF16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
}

// An FP8 weight's block scales multiply every element of their block: each
// must be finite and positive (a zero scale erases its block, a negative one
// flips it; neither comes out of a quantizer) and at most kMaxFp8BlockScale.
// Scales are 1/16384 of their weight's elements: a scalar loop is enough.
int64_t FirstBadScale(const Region& r, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float v = ElementAsFloat(r.dtype, r.data, i);
    if (!(std::isfinite(v) && v > 0 && v <= kMaxFp8BlockScale)) return i;
  }
  return -1;
}

int64_t FirstBad(const Region& r, int64_t begin, int64_t end) {
  if (r.scales) return FirstBadScale(r, begin, end);
  switch (r.dtype) {
    case DType::kF8E4M3:
      return FirstAllOnes<uint8_t>(r.data, begin, end, 0x7f);
    case DType::kBF16:
      return FirstAllOnes<uint16_t>(r.data, begin, end, 0x7f80);
    case DType::kF16:
      return FirstAllOnes<uint16_t>(r.data, begin, end, 0x7c00);
    case DType::kF32:
      return FirstAllOnes<uint32_t>(r.data, begin, end, 0x7f800000u);
    case DType::kInvalid:
      break;
  }
  return -1;
}

// "[1, 44]": the multi-index of flat element `i` of `shape`.
std::string IndexString(const std::vector<int64_t>& shape, int64_t i) {
  std::vector<int64_t> index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    const int64_t n = std::max<int64_t>(shape[d], 1);
    index[d] = i % n;
    i /= n;
  }
  return absl::StrCat("[", absl::StrJoin(index, ", "), "]");
}

absl::Status BadValueError(const Model& model, const Region& r, int64_t i) {
  const float v = ElementAsFloat(r.dtype, r.data, i);
  const std::string where = absl::StrCat(
      model.id, ": tensor ", r.spec->name, r.scales ? "_scale_inv" : "", " (",
      std::string(DTypeName(r.dtype)), " ", Tensor{.shape = *r.shape}.ShapeString(), ") holds ");
  const std::string at = absl::StrCat(" at element ", i, " (index ", IndexString(*r.shape, i), ")");
  if (r.scales) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, v, at, "; an FP8 block scale must be finite, > 0 and <= ", kMaxFp8BlockScale,
        " (448 x scale under 2^64, so that the FP8 GEMMs cannot overflow to Inf); ", kFix));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(where, std::isnan(v) ? "NaN" : (v > 0 ? "+Inf" : "-Inf"), at, "; ", kFix));
}

void AddRegions(const WeightSpec& spec, const Tensor& t, std::vector<Region>* regions) {
  if (!t.valid()) return;
  if (t.fp8() && t.scale_inv.valid()) {
    regions->push_back({&spec, true, t.scale_inv.dtype, &t.scale_inv.shape, t.scale_inv.data,
                        t.scale_inv.numel()});
  }
  regions->push_back({&spec, false, t.dtype, &t.shape, t.data, t.numel()});
}

}  // namespace

absl::Status CheckWeightsFinite(const Model& model, WeightCheckStats* stats, int threads) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<WeightSpec> specs = DecoderWeightSpecs(model.config);
  const WeightSpec head = LmHeadSpec(model.config);
  std::vector<Region> regions;
  for (const WeightSpec& spec : specs) AddRegions(spec, WeightSlot(model.weights, spec), &regions);
  const Tensor& lm_head = WeightSlot(model.weights, head);
  if (lm_head.data != model.weights.embed_tokens.data) {  // tied: scanned as embed_tokens
    AddRegions(head, lm_head, &regions);
  }

  std::vector<Chunk> chunks;
  int64_t bytes = 0;
  for (size_t r = 0; r < regions.size(); ++r) {
    const int64_t size = static_cast<int64_t>(DTypeSize(regions[r].dtype));
    const int64_t per_chunk = kChunkBytes / size;
    bytes += regions[r].numel * size;
    for (int64_t b = 0; b < regions[r].numel; b += per_chunk) {
      chunks.push_back({static_cast<int32_t>(r), b, std::min(regions[r].numel, b + per_chunk)});
    }
  }

  // Threads take chunks in order; `first_bad` is the lowest chunk found bad
  // so far, and chunks after it are skipped. Every chunk before the final
  // one was scanned clean, so the error names the first bad value in
  // canonical order whatever the threads' timing.
  const int64_t n = static_cast<int64_t>(chunks.size());
  std::vector<int64_t> bad_at(chunks.size(), -1);
  std::atomic<int64_t> next{0}, first_bad{n};
  auto work = [&] {
    for (int64_t c = next.fetch_add(1); c < n; c = next.fetch_add(1)) {
      if (c > first_bad.load(std::memory_order_relaxed)) continue;
      const Chunk& k = chunks[static_cast<size_t>(c)];
      const int64_t bad = FirstBad(regions[static_cast<size_t>(k.region)], k.begin, k.end);
      if (bad < 0) continue;
      bad_at[static_cast<size_t>(c)] = bad;
      int64_t seen = first_bad.load();
      while (c < seen && !first_bad.compare_exchange_weak(seen, c)) {
      }
    }
  };
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = static_cast<int>(std::clamp<int64_t>(n, 1, threads));
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();

  if (stats != nullptr) {
    stats->tensors = static_cast<int64_t>(regions.size());
    stats->bytes = bytes;
    stats->threads = threads;
    stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (const int64_t c = first_bad.load(); c < n) {
    const Chunk& k = chunks[static_cast<size_t>(c)];
    return BadValueError(model, regions[static_cast<size_t>(k.region)],
                         bad_at[static_cast<size_t>(c)]);
  }
  return absl::OkStatus();
}

}  // namespace draftfeed
