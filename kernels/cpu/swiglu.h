// CPU reference SwiGLU, the activation of the gated FFN.
#pragma once

#include <cstdint>

namespace draftfeed::cpu {

// out[i] = SiLU(gate[i])·up[i] for i < n, with SiLU(x) = x·sigmoid(x).
// out may alias gate or up.
void SwiGlu(const float* gate, const float* up, int64_t n, float* out);

}  // namespace draftfeed::cpu
