// OCP FP8 E4M3 ("e4m3fn"): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
// infinities, 0x7f/0xff are NaN, the largest finite magnitude is 448. One
// definition for every host user: the checkpoint loader and quantizer (weights
// with 128x128 block scales), the CPU engine's capture encoder and the client's
// decoder (hidden states with one scale per token and layer). The conversions
// match the hardware's (cvt.rn.satfinite.e4m3x2.f32, __nv_cvt_float_to_fp8 with
// __NV_SATFINITE): round to nearest even, saturate to +-448, NaN to NaN.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace draftfeed {

inline constexpr float kE4m3Max = 448.0f;

// Exact: every e4m3 value is a float.
inline constexpr float E4m3ToFloat(uint8_t v) {
  const float sign = (v & 0x80) ? -1.0f : 1.0f;
  const int exp = (v >> 3) & 0xf;
  const int man = v & 0x7;
  if (exp == 0xf && man == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) return sign * static_cast<float>(man) * (1.0f / 512.0f);  // 2^-6 * man/8
  // 2^(exp-7) * (1 + man/8), built without ldexp so it stays constexpr.
  float scale = 1.0f;
  for (int e = exp; e > 7; --e) scale *= 2.0f;
  for (int e = exp; e < 7; ++e) scale *= 0.5f;
  return sign * scale * (1.0f + static_cast<float>(man) / 8.0f);
}

namespace fp8_internal {
inline constexpr std::array<float, 256> MakeE4m3Table() {
  std::array<float, 256> t{};
  for (int i = 0; i < 256; ++i) t[i] = E4m3ToFloat(static_cast<uint8_t>(i));
  return t;
}
inline constexpr std::array<float, 256> kE4m3Table = MakeE4m3Table();
}  // namespace fp8_internal

// Table form for hot loops (dequantizing a weight or a capture).
inline float E4m3ToFloatFast(uint8_t v) { return fp8_internal::kE4m3Table[v]; }

// Round to nearest even, saturating: |f| >= 448 (and +-inf) gives +-448.
inline uint8_t FloatToE4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const float a = std::fabs(f);
  if (a >= kE4m3Max) return sign | 0x7e;  // 448 = 2^8 * 1.75
  // Subnormals and the smallest normals share the spacing 2^-9 below 2^-6;
  // above, the spacing is 2^(e-3) for a in [2^e, 2^(e+1)).
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1): a in [2^(e-1), 2^e)
  const int unbiased = e - 1;
  const int step_exp = (unbiased < -6 ? -6 : unbiased) - 3;
  // a / 2^step_exp rounded to nearest even, as an integer count of steps.
  const float steps = std::nearbyint(std::ldexp(a, -step_exp));  // FE_TONEAREST: ties to even
  const float q = std::ldexp(steps, step_exp);
  if (q >= kE4m3Max) return sign | 0x7e;
  if (q == 0.0f) return sign;
  int qe;
  const float qm = std::frexp(q, &qe);  // q = qm * 2^qe
  const int qexp = qe - 1;              // q in [2^qexp, 2^(qexp+1))
  if (qexp < -6) {                      // subnormal: q = man * 2^-9
    return sign | static_cast<uint8_t>(static_cast<int>(steps));
  }
  const int man = static_cast<int>(std::lround((qm * 2.0f - 1.0f) * 8.0f));
  return sign | static_cast<uint8_t>(((qexp + 7) << 3) | man);
}

}  // namespace draftfeed
