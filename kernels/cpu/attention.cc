#include "kernels/cpu/attention.h"

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cpu/attention_kernel.h"
#include "kernels/cpu/parallel.h"

namespace draftfeed::cpu {
namespace {

using attention_internal::Item;
using attention_internal::Job;
using attention_internal::kBk;
using attention_internal::kBq;
using attention_internal::Kernel;
using attention_internal::LaneBlock;
using attention_internal::StateFloats;
using attention_internal::WorkspaceFloats;

// Lane blocks per item: up to kItemPositions query positions, their running
// state within kItemStateBytes so that it stays in L2 beside a K/V block.
constexpr int64_t kItemPositions = 256;
constexpr int64_t kItemStateBytes = int64_t{256} << 10;

// One work item, in the widest instruction set the CPU has (picked once, at
// the first call): 16-float vectors with x86-64-v4 (AVX-512), 8 with -v3
// (AVX2 + FMA), 4 otherwise; register tiles sized to each one's registers
// (32, 16 and 16 of them). The lanes are independent, so the width does not
// change a row's arithmetic, and the file is built with -ffp-contract=off so
// that v3 and v4 do not fuse multiply-adds the baseline rounds twice: every
// machine computes the same bits.
using AttendFn = void (*)(const Job&, const Item&, float*, int32_t*);

void AttendBase(const Job& job, const Item& it, float* ws, int32_t* ws_pos) {
  Kernel<4, 1, 1>::Attend(job, it, ws, ws_pos);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("arch=x86-64-v3"))) void AttendV3(const Job& job, const Item& it, float* ws,
                                                        int32_t* ws_pos) {
  Kernel<8, 2, 2>::Attend(job, it, ws, ws_pos);
}
__attribute__((target("arch=x86-64-v4"))) void AttendV4(const Job& job, const Item& it, float* ws,
                                                        int32_t* ws_pos) {
  Kernel<16, 8, 8>::Attend(job, it, ws, ws_pos);
}
#endif

AttendFn PickAttend() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  if (__builtin_cpu_supports("x86-64-v4")) return AttendV4;
  if (__builtin_cpu_supports("x86-64-v3")) return AttendV3;
#endif
  return AttendBase;
}

// The path in use: PickAttend's, unless a test pinned one.
std::atomic<AttendFn>& Attend() {
  static std::atomic<AttendFn> attend{PickAttend()};
  return attend;
}

[[noreturn, gnu::format(printf, 1, 2)]] void Fail(const char* format, ...) {
  std::fprintf(stderr, "draftfeed::cpu::VarlenCausalAttention: ");
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fprintf(stderr, "\n");
  std::abort();
}

}  // namespace

void VarlenCausalAttention(const float* q, const float* k, const float* v, const int32_t* cu_q,
                           const int32_t* cu_k, int64_t num_seqs, int64_t num_q_heads,
                           int64_t num_kv_heads, int64_t head_dim, float scale, float* out,
                           int num_threads) {
  if (num_q_heads <= 0 || num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0) {
    Fail("num_kv_heads %lld must be positive and divide num_q_heads %lld",
         static_cast<long long>(num_kv_heads), static_cast<long long>(num_q_heads));
  }
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t heads = std::min(group, kBq), rows_per_block = kBq / heads;
  // Lane blocks per item: up to kItemPositions positions, and their state
  // within kItemStateBytes so that it stays in L2 beside a K/V block.
  const int64_t per_item = std::max<int64_t>(
      1, std::min(kItemPositions / rows_per_block,
                  kItemStateBytes /
                      (StateFloats(std::max<int64_t>(head_dim, 1)) * int64_t{sizeof(float)})));
  std::vector<LaneBlock> lane_blocks;
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = cu_q[s + 1] - cu_q[s], kv_len = cu_k[s + 1] - cu_k[s];
    if (q_len < 0 || kv_len < q_len) {
      Fail("sequence %lld: %lld queries and %lld keys (need 0 <= queries <= keys)",
           static_cast<long long>(s), static_cast<long long>(q_len),
           static_cast<long long>(kv_len));
    }
    // Lane blocks: the queries split at key-block boundaries of their
    // positions, then into rows_per_block rows.
    const int64_t first_block = static_cast<int64_t>(lane_blocks.size());
    for (int64_t pos = kv_len - q_len; pos < kv_len;) {
      const int64_t end = std::min(kv_len, (pos / kBk + 1) * kBk);
      while (pos < end) {
        const int64_t rows = std::min(rows_per_block, end - pos);
        lane_blocks.push_back({cu_q[s] + pos - (kv_len - q_len), pos, rows});
        pos += rows;
      }
    }
    const int64_t end_block = static_cast<int64_t>(lane_blocks.size());
    // Items: per_item lane blocks at a time, for each KV head's query heads
    // (in chunks of kBq if it has more).
    for (int64_t b0 = first_block; b0 < end_block; b0 += per_item) {
      const int64_t n = std::min(per_item, end_block - b0);
      int64_t cost = 0;
      for (int64_t x = b0; x < b0 + n; ++x) cost += lane_blocks[x].pos / kBk + 1;
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += heads) {
          items.push_back(
              {cu_k[s], kv_len, b0, n, h0, std::min(heads, (g + 1) * group - h0), cost});
        }
      }
    }
  }
  if (items.empty() || head_dim <= 0) return;
  // Largest first: the dynamic hand-out then ends on small items and the
  // threads finish together.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  Job job = {q, k, v, out, lane_blocks.data()};
  job.hq = num_q_heads;
  job.hkv = num_kv_heads;
  job.hd = head_dim;
  job.group = group;
  job.scale2 = static_cast<float>(static_cast<double>(scale) * 1.44269504088896340736);
  const AttendFn attend = Attend().load(std::memory_order_relaxed);
  ParallelFor(static_cast<int64_t>(items.size()), num_threads, [&](int64_t i) {
    thread_local std::vector<float> ws;
    thread_local std::vector<int32_t> ws_pos;
    ws.resize(static_cast<size_t>(WorkspaceFloats(head_dim, per_item)));
    ws_pos.resize(static_cast<size_t>(per_item * kBq));
    attend(job, items[static_cast<size_t>(i)], ws.data(), ws_pos.data());
  });
}

bool UseAttentionPathForTesting(int path) {
  AttendFn fn = nullptr;
  switch (path) {
    case 0:
      fn = PickAttend();
      break;
    case 1:
      fn = AttendBase;
      break;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    case 2:
      if (__builtin_cpu_supports("x86-64-v3")) fn = AttendV3;
      break;
    case 3:
      if (__builtin_cpu_supports("x86-64-v4")) fn = AttendV4;
      break;
#endif
    default:
      break;
  }
  if (fn == nullptr) return false;
  Attend().store(fn);
  return true;
}

void VarlenCausalAttention(const float* q, const float* k, const float* v,
                           const int32_t* cu_seqlens, int64_t num_seqs, int64_t num_q_heads,
                           int64_t num_kv_heads, int64_t head_dim, float scale, float* out,
                           int num_threads) {
  VarlenCausalAttention(q, k, v, cu_seqlens, cu_seqlens, num_seqs, num_q_heads, num_kv_heads,
                        head_dim, scale, out, num_threads);
}

}  // namespace draftfeed::cpu
