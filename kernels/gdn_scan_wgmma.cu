// Gated DeltaNet prefill, kernel 2 of the chunked gated delta rule on sm_90a
// for key dim 128 (Qwen3.5/3.6): the scan of gdn.cu (its header says what
// it computes) with its products on wgmma instead of mma.sync.
//
// Why: the mma.sync scan runs one block of four warps per (sequence, head,
// 64 state columns), and every warp loads the chunk's W, q, k and M from
// shared memory into registers for itself; with one warp per scheduler the
// chunk step is latency-bound (2.8 us a chunk on an H200, 21% issue use).
// wgmma reads the shared operand once for the warpgroup, straight from shared
// memory, and its products run asynchronously. The state's transpose Sᵀ
// [64 value dims × 128 key dims] is one m64n128 accumulator (warp w holds
// value dims 16w..16w+15, in mma.sync's fragment layout), so the chain of
// products stays in registers exactly as in the mma.sync scan:
//   V_newᵀ = Sᵀ·Wᵀ, Oᵀ = Sᵀ·qᵀ     m64n64 each, B = [W; q] K-major
//   V_newᵀ = Uᵀ − V_newᵀ
//   Sᵀ ← e^{γ_last}·Sᵀ + (V_newᵀ·diag(kf))·k   m64n128, B = k N-major
//   Oᵀ = Oᵀ·diag(qf) + V_newᵀ·Mᵀ                m64n64, B = M K-major
// W, q, k and M sit in shared memory in the 128-byte-swizzled layout wgmma
// reads (sm90::SwizzledOffset), loaded by cp.async into kWgmmaScanStages
// buffers, two chunks ahead (two buffers measured the same; one, which lets
// two blocks share an SM, 1.18x slower at one 8K sequence, 1.06x at mixed).
#include "kernels/gdn_chunked.cuh"
#include "kernels/kernel_paths.cuh"
#include "kernels/wgmma_sm90.cuh"

namespace draftfeed::cuda::gdn_chunked {
namespace {

using sm90::FenceRegs;
using sm90::kArchWgmma;
using sm90::SmemDesc128B;
using sm90::SwizzledOffset;
using sm90::Wgmma;
using sm90::WgmmaCommit;
using sm90::WgmmaFence;
using sm90::WgmmaWait;

constexpr int kDk = 128;
constexpr int kSlice = 64;  // state (value) columns per block: one warpgroup's m64
constexpr int kThreads = 128;
static_assert(kThreads == kChunk * (kDk / 8) / 8 && kThreads == kChunk * (kSlice / 8) / 4,
              "load_chunk's row maps: 8 rows of 128 columns, 16 of 64 a pass");

// One chunk's operands. The swizzled tiles come first, each a multiple of
// 1024 bytes, so every stage keeps their 1024-byte alignment.
struct WgmmaScanSmem {
  static constexpr int kULd = kSlice + 8;  // U is read by ldmatrix.trans, padded
  static constexpr int kOLd = 16 + 8;
  static constexpr size_t kWq = 0;                     // [2 chunks][128 rows: W | q][128 B]
  static constexpr size_t kK = kWq + 2 * 128 * 128;    // [2 chunks][64 rows][128 B]
  static constexpr size_t kM = kK + 2 * kChunk * 128;  // [1 chunk][64 rows][128 B]
  static constexpr size_t kU = kM + kChunk * 128;      // [64][kULd]
  static constexpr size_t kF = kU + size_t{kChunk} * kULd * sizeof(bf16);
  static constexpr size_t kStage = (kF + kFactorFloats * sizeof(float) + 1023) / 1024 * 1024;
  static constexpr size_t kO = kWgmmaScanStages * kStage;  // per-warp output staging [64][kOLd]
  // + 1024: the dynamic shared memory base is aligned up to 1024 in the kernel.
  static constexpr size_t kBytes = kO + size_t{4} * kChunk * kOLd * sizeof(bf16) + 1024;
};

// Stores four 8×8 bf16 fragments (mma accumulator layout, packed) transposed:
// lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void StMatrixX4Trans(uint32_t addr, uint32_t r0, uint32_t r1,
                                                uint32_t r2, uint32_t r3) {
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
      "r"(r0), "r"(r1), "r"(r2), "r"(r3)
      : "memory");
}

template <int kDv>
__global__ void __launch_bounds__(kArchWgmma ? kThreads : 32, 1) GdnScanWgmmaKernel(GdnParams p) {
  if constexpr (kArchWgmma) {
    using L = WgmmaScanSmem;
    constexpr int kStages = kWgmmaScanStages;
    static_assert(kStages >= 2, "the loop keeps kStages − 1 chunks in flight");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
    const uint32_t smem_addr = SmemAddr(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int q4 = lane & 3;
    const int seq = blockIdx.x, head = blockIdx.y;
    const int slice0 = blockIdx.z * kSlice;
    const int kh = head / (p.num_v_heads / p.num_k_heads);
    const int64_t seq_begin = p.cu[seq], seq_end = p.cu[seq + 1];
    const int num_chunks = static_cast<int>((seq_end - seq_begin + kChunk - 1) / kChunk);
    const int64_t slot0 = FirstSlot(seq, static_cast<int32_t>(seq_begin));
    const bf16* q_base = p.qkv + static_cast<int64_t>(kh) * kDk;
    const bf16* k_base = q_base + static_cast<int64_t>(p.num_k_heads) * kDk;

    // Thread tid copies rows r0 + 8j of the 128-column tiles at column col
    // (and rows r1 + 16j of the 64-column ones at col1): rows of one thread
    // share r % 8, so each tile's swizzle is one offset plus 1024 B per 8 rows.
    const int r0 = tid >> 4, col = (tid & 15) * 8;
    const int r1 = tid >> 3, col1 = (tid & 7) * 8;
    const uint32_t w_off = L::kWq + SwizzledOffset<128>(r0, col);
    const uint32_t q_off = L::kWq + SwizzledOffset<128>(kChunk + r0, col);
    const uint32_t k_off = L::kK + SwizzledOffset<kChunk>(r0, col);
    const uint32_t m_off = L::kM + SwizzledOffset<kChunk>(r1, col1);
    auto load_chunk = [&](int c) {
      unsigned char* st = smem + (c % kStages) * L::kStage;
      const int64_t t0 = seq_begin + static_cast<int64_t>(c) * kChunk;
      const int n = static_cast<int>(min(static_cast<int64_t>(kChunk), seq_end - t0));
      const int64_t item = (slot0 + c) * p.num_v_heads + head;
      // [W; q]: rows 0–63 W, 64–127 q (rows past the sequence end read 0); k.
      const bf16* w_src = p.ws.w + item * kChunk * kDk + r0 * kDk + col;
      const bf16* q_src = q_base + (t0 + r0) * p.qkv_stride + col;
      const bf16* k_src = k_base + (t0 + r0) * p.qkv_stride + col;
#pragma unroll
      for (int j = 0; j < kChunk / 8; ++j) {
        // A row past the end reads nothing, but its address must stay valid.
        const bool valid = r0 + 8 * j < n;
        const int64_t off = 8 * j * p.qkv_stride;
        CpAsync16(st + w_off + 1024 * j, w_src + 8 * j * kDk, true);
        CpAsync16(st + q_off + 1024 * j, valid ? q_src + off : q_base, valid);
        CpAsync16(st + k_off + 1024 * j, valid ? k_src + off : k_base, valid);
      }
      const bf16* m_src = p.ws.m + item * kChunk * kChunk + r1 * kChunk + col1;
      bf16* s_u = reinterpret_cast<bf16*>(st + L::kU) + r1 * L::kULd + col1;
      const bf16* u_src = p.ws.u + item * kChunk * kDv + slice0 + r1 * kDv + col1;
#pragma unroll
      for (int j = 0; j < kChunk / 16; ++j) {
        CpAsync16(st + m_off + 2048 * j, m_src + 16 * j * kChunk, true);
        CpAsync16(s_u + 16 * j * L::kULd, u_src + 16 * j * kDv, true);
      }
      float* s_f = reinterpret_cast<float*>(st + L::kF);
      const float* f_src = p.ws.f + item * kFactorFloats;
      for (int i = tid; i < kFactorFloats / 4; i += kThreads)
        CpAsync16(s_f + 4 * i, f_src + 4 * i, true);
    };

    // Sᵀ, the m64n128 accumulator: element e of n-tile nt is value dim
    // slice0 + 16·warp + g + 8(e >> 1), key dim 8nt + 2q + (e & 1).
    float st_acc[kDk / 2];
#pragma unroll
    for (int i = 0; i < kDk / 2; ++i) st_acc[i] = 0.0f;
    const int d0 = 16 * warp;
    bf16* s_o = reinterpret_cast<bf16*>(smem + L::kO) + warp * kChunk * L::kOLd;
    const auto state_index = [&](int nt, int e) {
      return StateOffset(head, kDk, kDv, slice0 + d0, nt, e);
    };
    if (seq == 0 && p.initial_state != nullptr) {
#pragma unroll
      for (int nt = 0; nt < kDk / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) st_acc[4 * nt + e] = p.initial_state[state_index(nt, e)];
      }
    }

    // kStages − 1 chunks in flight ahead of the one computed. Chunk
    // c + kStages − 1 is loaded after the barrier that ends every warp's use
    // of its stage (the one chunk c − 1 used), so one barrier a chunk is
    // enough.
#pragma unroll
    for (int c = 0; c < kStages - 1; ++c) {
      if (c < num_chunks) load_chunk(c);
      CpAsyncCommit();
    }
    for (int c = 0; c < num_chunks; ++c) {
      CpAsyncWait<kStages - 2>();
      // cp.async writes are generic-proxy writes; wgmma reads through the
      // async proxy.
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();
      if (c + kStages - 1 < num_chunks) load_chunk(c + kStages - 1);
      CpAsyncCommit();

      const uint32_t st_addr = smem_addr + (c % kStages) * L::kStage;
      const unsigned char* st = smem + (c % kStages) * L::kStage;
      const bf16* s_u = reinterpret_cast<const bf16*>(st + L::kU);
      const float* s_f = reinterpret_cast<const float*>(st + L::kF);

      // Sᵀ as bf16 A fragments, k-step ks = key dims 16ks..16ks+15.
      uint32_t sa[kDk / 16][4];
      sm80::AccumulatorToA(st_acc, sa);
      // Sᵀ·Wᵀ (the state's critical path) and Sᵀ·qᵀ as two groups, so the
      // state update can be issued while the second still runs.
      float vw[32], o[32];
      FenceRegs(sa);
      WgmmaFence();
      {
        const uint64_t bw = SmemDesc128B(st_addr + L::kWq, 16, 1024);
        const uint64_t bq = bw + ((kChunk * 128) >> 4);  // rows 64–127
        Wgmma<64>::RS<0, 0>(vw, sa[0], bw);              // = , not +=
#pragma unroll
        for (int ks = 1; ks < kDk / 16; ++ks) {
          Wgmma<64>::RS<1, 0>(vw, sa[ks], bw + (((ks / 4) * (128 * 128) + (ks % 4) * 32) >> 4));
        }
        WgmmaCommit();
        Wgmma<64>::RS<0, 0>(o, sa[0], bq);
#pragma unroll
        for (int ks = 1; ks < kDk / 16; ++ks) {
          Wgmma<64>::RS<1, 0>(o, sa[ks], bq + (((ks / 4) * (128 * 128) + (ks % 4) * 32) >> 4));
        }
        WgmmaCommit();
      }
      WgmmaWait<1>();
      FenceRegs(vw);

      // V_newᵀ = Uᵀ − Sᵀ·Wᵀ, Uᵀ in accumulator layout from transposed 8×8 loads.
      float vn[32];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        uint32_t u[4];
        LdMatrixX4Trans(u, s_u + (16 * jj + (lane & 7) + (lane >> 4) * 8) * L::kULd + d0 +
                               ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float2 lo = UnpackBf16(u[2 * h]), hi = UnpackBf16(u[2 * h + 1]);
          const int b = 4 * (2 * jj + h);
          vn[b + 0] = lo.x - vw[b + 0];
          vn[b + 1] = lo.y - vw[b + 1];
          vn[b + 2] = hi.x - vw[b + 2];
          vn[b + 3] = hi.y - vw[b + 3];
        }
      }
      // A fragments, k-step ks = tokens 16ks..16ks+15: V_newᵀ·diag(kf) for the
      // state, V_newᵀ for the output.
      uint32_t vk[4][4], va[4][4];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const float2 kf0 = *reinterpret_cast<const float2*>(s_f + kChunk + 16 * ks + 2 * q4);
        const float2 kf1 = *reinterpret_cast<const float2*>(s_f + kChunk + 16 * ks + 8 + 2 * q4);
        const float* v0 = vn + 8 * ks;
        const float* v1 = vn + 8 * ks + 4;
        vk[ks][0] = PackBf16(v0[0] * kf0.x, v0[1] * kf0.y);
        vk[ks][1] = PackBf16(v0[2] * kf0.x, v0[3] * kf0.y);
        vk[ks][2] = PackBf16(v1[0] * kf1.x, v1[1] * kf1.y);
        vk[ks][3] = PackBf16(v1[2] * kf1.x, v1[3] * kf1.y);
        va[ks][0] = PackBf16(v0[0], v0[1]);
        va[ks][1] = PackBf16(v0[2], v0[3]);
        va[ks][2] = PackBf16(v1[0], v1[1]);
        va[ks][3] = PackBf16(v1[2], v1[3]);
      }
      const float decay = s_f[2 * kChunk];
#pragma unroll
      for (int i = 0; i < kDk / 2; ++i) st_acc[i] *= decay;

      // Sᵀ += (V_newᵀ·diag(kf))·k, queued behind Sᵀ·qᵀ.
      FenceRegs(st_acc);
      FenceRegs(vk);
      WgmmaFence();
      {
        const uint64_t bk = SmemDesc128B(st_addr + L::kK, kChunk * 128, 1024);
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          Wgmma<128>::RS<1, 1>(st_acc, vk[ks], bk + ((ks * 16 * 128) >> 4));
        }
      }
      WgmmaCommit();
      WgmmaWait<1>();  // Sᵀ·qᵀ done
      FenceRegs(o);
      FenceRegs(sa);

      // Oᵀ = Oᵀ·diag(qf) + V_newᵀ·Mᵀ.
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const float2 qf = *reinterpret_cast<const float2*>(s_f + 8 * nt + 2 * q4);
        o[4 * nt + 0] *= qf.x;
        o[4 * nt + 1] *= qf.y;
        o[4 * nt + 2] *= qf.x;
        o[4 * nt + 3] *= qf.y;
      }
      FenceRegs(o);
      FenceRegs(va);
      WgmmaFence();
      {
        const uint64_t bm = SmemDesc128B(st_addr + L::kM, 16, 1024);
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) Wgmma<64>::RS<1, 0>(o, va[ks], bm + ((ks * 32) >> 4));
      }
      WgmmaCommit();
      WgmmaWait<0>();
      FenceRegs(st_acc);
      FenceRegs(o);
      FenceRegs(vk);
      FenceRegs(va);

      // Stage the warp's [64 tokens × 16 dims] through shared memory,
      // transposed by stmatrix (matrix i of x4 m: token tile 2m + i/2, dims
      // 8(i % 2)..), then 16-byte stores of whole 32-byte row pieces.
      {
        const int i = lane >> 3, j = lane & 7;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const float* o0 = o + 8 * m;
          const float* o1 = o + 8 * m + 4;
          StMatrixX4Trans(SmemAddr(s_o + (8 * (2 * m + (i >> 1)) + j) * L::kOLd + 8 * (i & 1)),
                          PackBf16(o0[0], o0[1]), PackBf16(o0[2], o0[3]), PackBf16(o1[0], o1[1]),
                          PackBf16(o1[2], o1[3]));
        }
      }
      __syncwarp();
      const int64_t t0 = seq_begin + static_cast<int64_t>(c) * kChunk;
      const int n = static_cast<int>(min(static_cast<int64_t>(kChunk), seq_end - t0));
      StoreStagedOutput(s_o, L::kOLd, p.out, t0, n, p.num_v_heads, head, kDv, slice0 + d0);
      __syncwarp();
    }
    CpAsyncWait<0>();
    if (seq == p.num_seqs - 1 && p.final_state != nullptr) {
#pragma unroll
      for (int nt = 0; nt < kDk / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) p.final_state[state_index(nt, e)] = st_acc[4 * nt + e];
      }
    }
  }
}

}  // namespace

bool WgmmaScanAvailable() {
  if (!HopperKernelsAllowed()) return false;
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, GdnScanWgmmaKernel<128>) != cudaSuccess) {
    cudaGetLastError();  // not sticky; clear it
    return false;
  }
  return attr.maxThreadsPerBlock == kThreads;
}

template <int kDv>
cudaError_t LaunchWgmmaScan(const GdnParams& p, cudaStream_t stream) {
  static_assert(kHasWgmmaScan<kDk, kDv>, "the wgmma scan takes dk = 128, 64 state columns a block");
  using L = WgmmaScanSmem;
  const auto kernel = GdnScanWgmmaKernel<kDv>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(L::kBytes));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.num_v_heads),
                  kDv / kSlice);
  kernel<<<grid, kThreads, L::kBytes, stream>>>(p);
  return cudaGetLastError();
}

template cudaError_t LaunchWgmmaScan<64>(const GdnParams&, cudaStream_t);
template cudaError_t LaunchWgmmaScan<128>(const GdnParams&, cudaStream_t);

}  // namespace draftfeed::cuda::gdn_chunked
