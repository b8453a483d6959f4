// Host tensors as the loader hands them out: a typed view into storage that
// something else owns (an mmap of a safetensors file, or a buffer made in
// memory for the built-in random models).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace draftfeed {

enum class DType : uint8_t { kInvalid, kBF16, kF16, kF32 };

std::string_view DTypeName(DType dtype);  // "BF16", "F16", "F32" (safetensors spelling)
size_t DTypeSize(DType dtype);

struct Tensor {
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;  // not owned; valid while the owning Model lives

  bool valid() const { return data != nullptr; }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype); }
  std::string ShapeString() const;  // e.g. "[128, 64]"
};

// Widens any supported dtype to fp32 (exact for bf16 and fp16).
std::vector<float> ToFloat(const Tensor& t);

// bf16 helpers: round-to-nearest-even, NaN preserved.
uint16_t FloatToBf16(float f);
float Bf16ToFloat(uint16_t b);
float Fp16ToFloat(uint16_t h);
uint16_t FloatToFp16(float f);

}  // namespace draftfeed
