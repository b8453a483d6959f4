// Host tensors as the loader hands them out: a typed view into storage that
// something else owns (an mmap of a safetensors file, or a buffer made in
// memory for the built-in random models). FP8 weights (OCP e4m3) carry
// their 128x128 block scales beside them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace draftfeed {

enum class DType : uint8_t { kInvalid, kBF16, kF16, kF32, kF8E4M3 };

// "BF16", "F16", "F32", "F8_E4M3" (safetensors spelling)
std::string_view DTypeName(DType dtype);
size_t DTypeSize(DType dtype);

// Edge of the square weight blocks that share one FP8 scale (the only block
// size fine-grained FP8 checkpoints use; config.json's weight_block_size).
inline constexpr int64_t kFp8BlockSize = 128;

// The dequantization multipliers of an FP8 weight (HF's `weight_scale_inv`):
//   W[.., r, c] = float(e4m3 W[.., r, c]) * float(s[.., r / 128, c / 128])
// A partial last block shares its scale.
struct BlockScales {
  DType dtype = DType::kInvalid;    // as stored: BF16, F16 or F32
  std::vector<int64_t> shape;       // [ceil(rows/128), ceil(cols/128)], or [E, ...] when stacked
  const std::byte* data = nullptr;  // not owned, like Tensor::data

  bool valid() const { return data != nullptr; }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype); }
};

// The scale shape an FP8 weight of `weight_shape` ([.., rows, cols]) needs.
std::vector<int64_t> Fp8ScaleShape(const std::vector<int64_t>& weight_shape);

struct Tensor {
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;  // not owned; valid while the owning Model lives
  BlockScales scale_inv;            // kF8E4M3 only (shape set even when data is on the device)

  bool fp8() const { return dtype == DType::kF8E4M3; }

  bool valid() const { return data != nullptr; }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype); }
  std::string ShapeString() const;  // e.g. "[128, 64]"
};

// Widens any supported dtype to fp32 (exact for bf16 and fp16). An FP8 tensor
// is dequantized with its block scales, each element exactly
// float(e4m3) * float(scale) rounded once to fp32; it must carry scales of
// Fp8ScaleShape (the loader and the quantizer guarantee it; anything else is a
// programmer error and aborts).
std::vector<float> ToFloat(const Tensor& t);

// bf16 helpers: round-to-nearest-even, NaN preserved.
uint16_t FloatToBf16(float f);
float Bf16ToFloat(uint16_t b);
float Fp16ToFloat(uint16_t h);
uint16_t FloatToFp16(float f);

}  // namespace draftfeed
