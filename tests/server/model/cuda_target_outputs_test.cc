// The CUDA engine's target outputs (each row: the hidden capture, then the
// token's argmax, top-k and draft probs) on the built-in tiny models and the
// checked-in checkpoints (FP8 ones included: their lm_head stays bf16):
//   - against lm_head applied here, in double, to the engine's own bf16
//     final-norm states (its -1 capture): the op's definitions, to the
//     encodings' rounding;
//   - against the CPU engine's outputs: ids wherever the CPU's logits (from
//     its fp32 final states) leave a gap wider than twice the two engines'
//     logit difference (and at least 1e-3), the probs' total variation no
//     more than the encodings add to what the two forwards' own states give;
//   - the hidden part of each row is the hidden-only run's, byte for byte;
//     outputs alone (no layers) are the same bytes; ForwardAsync and a
//     device sink carry what Forward returns.
// Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/fp8_e4m3.h"
#include "common/host_buffer_pool.h"
#include "common/payload_checksum.h"
#include "common/target_outputs.h"
#include "server/model/cpu_engine.h"
#include "server/model/cuda_engine.h"
#include "server/model/tensor.h"
#include "tests/test_data_dir.h"

namespace draftfeed {
namespace {

template <typename T>
T Read(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

struct Batch {
  std::vector<int32_t> ids, lens;
};

Batch MakeBatch(int64_t vocab, std::vector<int32_t> lens, uint64_t seed) {
  Batch b{{}, std::move(lens)};
  std::mt19937_64 rng(seed);
  const int total = std::accumulate(b.lens.begin(), b.lens.end(), 0);
  for (int i = 0; i < total; ++i) b.ids.push_back(static_cast<int32_t>(rng() % uint64_t(vocab)));
  return b;
}

std::vector<int32_t> ShuffledIds(int64_t vocab, int64_t n, uint64_t seed) {
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(seed));
  ids.resize(static_cast<size_t>(n));
  return ids;
}

std::vector<std::byte> Rows(Engine& e, const Batch& b, std::span<const int32_t> layers,
                            const TargetOutputs* o, CaptureEncoding enc = CaptureEncoding::kBf16) {
  ForwardInput in{b.ids, b.lens, layers, enc};
  in.outputs = o;
  std::vector<std::byte> out(CaptureBytes(e.model().config, in));
  const absl::Status s = e.Forward(in, out);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// logits [T, V] in double from states [T, D] and head [V, D].
std::vector<double> Logits(const std::vector<float>& head, const std::vector<float>& states,
                           int64_t d, int64_t v) {
  const auto tokens = static_cast<int64_t>(states.size()) / d;
  std::vector<double> lg(static_cast<size_t>(tokens * v));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < v; ++i) {
      double s = 0;
      for (int64_t k = 0; k < d; ++k) s += double(states[t * d + k]) * head[i * d + k];
      lg[t * v + i] = s;
    }
  }
  return lg;
}

// Capture slot `slot` of K bf16 slots, widened: [T, D].
std::vector<float> Slot(const std::vector<std::byte>& rows, int64_t row, int64_t tokens,
                        int64_t slot, int64_t d) {
  std::vector<float> s(static_cast<size_t>(tokens * d));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < d; ++i) {
      s[t * d + i] = Bf16ToFloat(Read<uint16_t>(rows.data() + t * row + 2 * (slot * d + i)));
    }
  }
  return s;
}

// Ids by (logit descending, id ascending).
std::vector<int32_t> Order(const double* lg, int64_t v) {
  std::vector<int32_t> order(static_cast<size_t>(v));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [lg](int32_t a, int32_t b) { return lg[a] > lg[b]; });
  return order;
}

std::vector<double> DraftSoftmax(const double* lg, const std::vector<int32_t>& draft) {
  double md = -INFINITY, sum = 0;
  for (int32_t id : draft) md = std::max(md, lg[id]);
  for (int32_t id : draft) sum += std::exp(lg[id] - md);
  std::vector<double> p;
  for (int32_t id : draft) p.push_back(std::exp(lg[id] - md) / sum);
  return p;
}

struct Decoded {
  int32_t argmax = -1;
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  std::vector<double> probs;
  float scale = 1.0f;
};

Decoded Decode(const std::byte* out, const TargetOutputs& o) {
  const TargetOutputsLayout l = LayoutOf(o);
  Decoded d;
  if (o.argmax) d.argmax = Read<int32_t>(out + l.argmax);
  for (int32_t i = 0; i < o.top_k; ++i) {
    d.ids.push_back(Read<int32_t>(out + l.top_k_ids + 4 * i));
    d.logprobs.push_back(Read<float>(out + l.top_k_logprobs + 4 * i));
  }
  const bool fp8 = o.probs_encoding == CaptureEncoding::kFp8E4m3;
  if (fp8 && !o.draft_vocab.empty()) d.scale = Read<float>(out + l.probs_scale);
  for (size_t j = 0; j < o.draft_vocab.size(); ++j) {
    d.probs.push_back(fp8 ? double(E4m3ToFloat(Read<uint8_t>(out + l.probs + int64_t(j)))) * d.scale
                          : Bf16ToFloat(Read<uint16_t>(out + l.probs + 2 * int64_t(j))));
  }
  return d;
}

double Tv(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += std::fabs(a[i] - b[i]);
  return s / 2;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median total variation a token's probs may reach beyond the exact ones:
// bf16 rounds each by at most 2^-9 of itself; e4m3 by 2^-4 (3 mantissa bits).
double EncodingBudget(const TargetOutputs& o) {
  return o.probs_encoding == CaptureEncoding::kFp8E4m3 ? std::ldexp(1.0, -5) : std::ldexp(1.0, -8);
}

// Every token's outputs in `rows` (after `hidden` bytes) against logits `lg`
// computed from the very states lm_head read: ids where the gaps exceed the
// fp32 GEMM's error many times over, values to the encodings' rounding.
void ExpectExact(const std::vector<double>& lg, int64_t v, const TargetOutputs& o,
                 const std::vector<std::byte>& rows, int64_t hidden) {
  const int64_t row = hidden + LayoutOf(o).bytes;
  const auto tokens = static_cast<int64_t>(rows.size()) / row;
  ASSERT_EQ(tokens * row, static_cast<int64_t>(rows.size()));
  constexpr double kGap = 1e-3;
  int64_t argmax_checked = 0;
  std::vector<double> tv;
  for (int64_t t = 0; t < tokens; ++t) {
    SCOPED_TRACE(::testing::Message() << "token " << t);
    const double* l = lg.data() + t * v;
    const std::vector<int32_t> order = Order(l, v);
    const Decoded d = Decode(rows.data() + t * row + hidden, o);
    if (o.argmax && l[order[0]] - l[order[1]] > kGap) {
      EXPECT_EQ(d.argmax, order[0]);
      ++argmax_checked;
    }
    if (o.top_k > 0) {
      double sum = 0;
      for (int64_t i = 0; i < v; ++i) sum += std::exp(l[i] - l[order[0]]);
      const double lse = l[order[0]] + std::log(sum);
      for (int32_t i = 0; i < o.top_k; ++i) {
        const bool clear = l[order[i]] - l[order[i + 1]] > kGap &&
                           (i == 0 || l[order[i - 1]] - l[order[i]] > kGap);
        if (clear) {
          EXPECT_EQ(d.ids[i], order[i]) << "rank " << i;
        }
        ASSERT_GE(d.ids[i], 0);
        ASSERT_LT(d.ids[i], v);
        EXPECT_NEAR(d.logprobs[i], l[d.ids[i]] - lse, 2e-4) << "rank " << i;
      }
    }
    if (o.draft_vocab.empty()) continue;
    const std::vector<double> p = DraftSoftmax(l, o.draft_vocab);
    const bool fp8 = o.probs_encoding == CaptureEncoding::kFp8E4m3;
    for (size_t j = 0; j < p.size(); ++j) {
      // Half a bf16 ulp is 2^-9 of p; half an e4m3 step 2^-4 of p, or 2^-10
      // of the scale below the normals. Doubled for the GEMM's rounding.
      const double bound = fp8 ? 2 * std::max(p[j] / 16, d.scale * std::ldexp(1.0, -10))
                               : p[j] * std::ldexp(1.0, -8);
      EXPECT_NEAR(d.probs[j], p[j], bound + 1e-9) << "column " << j;
    }
    tv.push_back(Tv(d.probs, p));
  }
  if (o.argmax) {
    EXPECT_GT(argmax_checked, tokens / 2);
  }
  if (!tv.empty()) {
    EXPECT_LE(Median(tv), EncodingBudget(o));
  }
}

std::vector<float> Bf16Rounded(std::vector<float> f) {
  for (float& x : f) x = Bf16ToFloat(FloatToBf16(x));
  return f;
}

class CudaTargetOutputsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    absl::StatusOr<std::unique_ptr<Model>> m = OpenModel(GetParam());
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = *std::move(m);
    CudaEngineOptions opt;
    opt.max_tokens = 512;
    opt.max_seqs = 16;
    absl::StatusOr<std::unique_ptr<CudaEngine>> g = CudaEngine::Create(model_.get(), opt);
    ASSERT_TRUE(g.ok()) << g.status();
    gpu_ = *std::move(g);
    const ModelConfig& c = model_->config;
    batch_ = MakeBatch(c.vocab_size, {1, 40, 23, 100}, 11);
    draft_ = ShuffledIds(c.vocab_size, std::min<int64_t>(c.vocab_size, 100), 3);
    other_draft_ = ShuffledIds(c.vocab_size, std::min<int64_t>(c.vocab_size, 100), 4);
  }

  TargetOutputs Asked(CaptureEncoding probs, const std::vector<int32_t>& draft) const {
    return TargetOutputs{.argmax = true, .top_k = 5, .draft_vocab = draft, .probs_encoding = probs};
  }

  std::unique_ptr<Model> model_;
  std::unique_ptr<CudaEngine> gpu_;
  Batch batch_;
  std::vector<int32_t> draft_, other_draft_;
  const std::vector<int32_t> layers_ = {1, kFinalLayerId};
};

TEST_P(CudaTargetOutputsTest, RowsAreLmHeadOfTheFinalState) {
  const ModelConfig& c = model_->config;
  const int64_t T = static_cast<int64_t>(batch_.ids.size()), D = c.hidden_size, V = c.vocab_size;
  if (!gpu_->serves_target_outputs()) {
    const TargetOutputs o = Asked(CaptureEncoding::kBf16, draft_);
    ForwardInput in{batch_.ids, batch_.lens, layers_};
    in.outputs = &o;
    std::vector<std::byte> out(CaptureBytes(c, in));
    EXPECT_EQ(gpu_->Forward(in, out).code(), absl::StatusCode::kFailedPrecondition);
    GTEST_SKIP() << GetParam() << " has no lm_head";
  }
  const int64_t hidden = CaptureBytesPerToken(CaptureEncoding::kBf16, 2, D);
  const std::vector<std::byte> plain = Rows(*gpu_, batch_, layers_, nullptr);
  // What lm_head reads: the engine's bf16 final-norm states and bf16 head.
  const std::vector<double> lg =
      Logits(Bf16Rounded(ToFloat(model_->weights.lm_head)), Slot(plain, hidden, T, 1, D), D, V);
  std::vector<std::byte> first_bf16;
  for (const auto& [probs, draft] : {std::pair{CaptureEncoding::kBf16, draft_},
                                     std::pair{CaptureEncoding::kFp8E4m3, other_draft_},
                                     std::pair{CaptureEncoding::kBf16, draft_}}) {
    SCOPED_TRACE(::testing::Message() << "probs " << EncodingName(probs));
    const TargetOutputs o = Asked(probs, draft);
    const int64_t out_bytes = LayoutOf(o).bytes, row = hidden + out_bytes;
    const std::vector<std::byte> rows = Rows(*gpu_, batch_, layers_, &o);
    ASSERT_EQ(static_cast<int64_t>(rows.size()), T * row);
    for (int64_t t = 0; t < T; ++t) {
      ASSERT_EQ(std::memcmp(rows.data() + t * row, plain.data() + t * hidden, size_t(hidden)), 0)
          << "token " << t << ": the hidden part differs from the hidden-only run's";
    }
    ExpectExact(lg, V, o, rows, hidden);
    // Outputs alone: the same forward, the same bytes.
    const std::vector<std::byte> alone = Rows(*gpu_, batch_, {}, &o);
    ASSERT_EQ(static_cast<int64_t>(alone.size()), T * out_bytes);
    for (int64_t t = 0; t < T; ++t) {
      ASSERT_EQ(std::memcmp(alone.data() + t * out_bytes, rows.data() + t * row + hidden,
                            size_t(out_bytes)),
                0)
          << "token " << t;
    }
    // A draft vocabulary asked again after another: its index is rebuilt.
    if (first_bf16.empty()) {
      first_bf16 = rows;
    } else if (probs == CaptureEncoding::kBf16) {
      EXPECT_EQ(rows, first_bf16);
    }
  }
  // fp8 hidden states with outputs after them.
  const TargetOutputs o{.top_k = 3};
  const int64_t hidden8 = CaptureBytesPerToken(CaptureEncoding::kFp8E4m3, 2, D);
  const std::vector<std::byte> rows8 = Rows(*gpu_, batch_, layers_, &o, CaptureEncoding::kFp8E4m3);
  const std::vector<std::byte> plain8 =
      Rows(*gpu_, batch_, layers_, nullptr, CaptureEncoding::kFp8E4m3);
  const int64_t row8 = hidden8 + LayoutOf(o).bytes;
  for (int64_t t = 0; t < T; ++t) {
    ASSERT_EQ(std::memcmp(rows8.data() + t * row8, plain8.data() + t * hidden8, size_t(hidden8)), 0)
        << "token " << t;
  }
  ExpectExact(lg, V, o, rows8, hidden8);
}

TEST_P(CudaTargetOutputsTest, MatchTheCpuEngine) {
  if (!gpu_->serves_target_outputs()) GTEST_SKIP() << GetParam() << " has no lm_head";
  const ModelConfig& c = model_->config;
  const int64_t T = static_cast<int64_t>(batch_.ids.size()), D = c.hidden_size, V = c.vocab_size;
  absl::StatusOr<std::unique_ptr<CpuEngine>> cpu = CpuEngine::Create(model_.get(), 0);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::vector<float> cpu_states(static_cast<size_t>(T * D));
  const std::vector<int32_t> final_layer = {kFinalLayerId};
  ASSERT_TRUE((*cpu)->ForwardFloat({batch_.ids, batch_.lens, final_layer}, cpu_states).ok());
  const std::vector<double> lg_cpu = Logits(ToFloat(model_->weights.lm_head), cpu_states, D, V);
  const int64_t hidden = CaptureBytesPerToken(CaptureEncoding::kBf16, 2, D);
  for (CaptureEncoding probs : {CaptureEncoding::kBf16, CaptureEncoding::kFp8E4m3}) {
    SCOPED_TRACE(::testing::Message() << "probs " << EncodingName(probs));
    const TargetOutputs o = Asked(probs, draft_);
    const int64_t row = hidden + LayoutOf(o).bytes;
    const std::vector<std::byte> gpu_rows = Rows(*gpu_, batch_, layers_, &o);
    ForwardInput in{batch_.ids, batch_.lens, layers_};
    in.outputs = &o;
    std::vector<std::byte> cpu_rows(CaptureBytes(c, in));
    const absl::Status s = (*cpu)->Forward(in, cpu_rows);
    ASSERT_TRUE(s.ok()) << "the CPU engine's target outputs: " << s;
    const std::vector<double> lg_gpu =
        Logits(Bf16Rounded(ToFloat(model_->weights.lm_head)), Slot(gpu_rows, row, T, 1, D), D, V);
    std::vector<double> tv, forward_tv;
    int64_t argmax_checked = 0;
    for (int64_t t = 0; t < T; ++t) {
      SCOPED_TRACE(::testing::Message() << "token " << t);
      const double* lc = lg_cpu.data() + t * V;
      const double* lgpu = lg_gpu.data() + t * V;
      // Where the CPU's logits order two ids by more than twice the engines'
      // largest logit difference, the GPU's order them the same way.
      double diff = 0;
      for (int64_t i = 0; i < V; ++i) diff = std::max(diff, std::fabs(lc[i] - lgpu[i]));
      const double margin = std::max(1e-3, 2 * diff + 1e-4);
      const std::vector<int32_t> order = Order(lc, V);
      const Decoded g = Decode(gpu_rows.data() + t * row + hidden, o);
      const Decoded p = Decode(cpu_rows.data() + t * row + hidden, o);
      if (lc[order[0]] - lc[order[1]] > margin) {
        EXPECT_EQ(g.argmax, p.argmax);
        ++argmax_checked;
      }
      for (int32_t i = 0; i < o.top_k; ++i) {
        if (lc[order[i]] - lc[order[i + 1]] > margin &&
            (i == 0 || lc[order[i - 1]] - lc[order[i]] > margin)) {
          EXPECT_EQ(g.ids[i], p.ids[i]) << "rank " << i;
        }
        // A log-softmax moves by at most twice the logits' largest change.
        if (g.ids[i] == p.ids[i]) {
          EXPECT_NEAR(g.logprobs[i], p.logprobs[i], 2 * diff + 2e-4) << "rank " << i;
        }
      }
      tv.push_back(Tv(g.probs, p.probs));
      forward_tv.push_back(Tv(DraftSoftmax(lgpu, o.draft_vocab), DraftSoftmax(lc, o.draft_vocab)));
    }
    std::printf(
        "%s %s probs: median TV GPU-CPU %.2e (the states' own %.2e); argmax compared on "
        "%lld of %lld tokens\n",
        GetParam().c_str(), std::string(EncodingName(probs)).c_str(), Median(tv),
        Median(forward_tv), static_cast<long long>(argmax_checked), static_cast<long long>(T));
    // Both engines' encodings add to what their states already differ by.
    EXPECT_LE(Median(tv), Median(forward_tv) + 2 * EncodingBudget(o));
  }
}

// Collects ForwardAsync callbacks (they run on the engine's copy thread).
class CopyLog {
 public:
  Engine::CopiedCallback For(int batch) {
    return [this, batch](Engine::Copied c) {
      std::lock_guard<std::mutex> lock(mu_);
      statuses_.push_back(std::move(c.status));
      checksums_[static_cast<size_t>(batch)] = c.checksum;
      cv_.notify_all();
    };
  }
  bool WaitFor(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(60), [&] { return statuses_.size() >= n; });
  }
  bool all_ok() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::all_of(statuses_.begin(), statuses_.end(),
                       [](const absl::Status& s) { return s.ok(); });
  }
  std::optional<uint64_t> checksum(int batch) {
    std::lock_guard<std::mutex> lock(mu_);
    return checksums_[static_cast<size_t>(batch)];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<absl::Status> statuses_;
  std::optional<uint64_t> checksums_[8];
};

TEST_P(CudaTargetOutputsTest, ForwardAsyncAndDeviceSinkCarryForwardsRows) {
  if (!gpu_->serves_target_outputs()) GTEST_SKIP() << GetParam() << " has no lm_head";
  // Rows of three widths back to back (fp8 hidden states, outputs alone,
  // bf16 hidden states), so that both buffers are written, and grown.
  const TargetOutputs fp8 = Asked(CaptureEncoding::kFp8E4m3, draft_);
  const TargetOutputs bf16 = Asked(CaptureEncoding::kBf16, other_draft_);
  struct Job {
    std::span<const int32_t> layers;
    const TargetOutputs* o;
    CaptureEncoding enc;
  };
  const std::vector<Job> jobs = {{layers_, &fp8, CaptureEncoding::kFp8E4m3},
                                 {{}, &bf16, CaptureEncoding::kBf16},
                                 {layers_, &bf16, CaptureEncoding::kBf16}};
  std::vector<std::vector<std::byte>> want;
  for (const Job& j : jobs) want.push_back(Rows(*gpu_, batch_, j.layers, j.o, j.enc));
  HostBufferPool pinned(0, PinnedHostAllocator());
  std::vector<std::shared_ptr<std::byte>> out;
  CopyLog log;
  for (size_t i = 0; i < jobs.size(); ++i) {
    out.push_back(std::reinterpret_pointer_cast<std::byte>(pinned.Acquire(want[i].size())));
    ASSERT_NE(out.back(), nullptr);
    std::memset(out.back().get(), 0xa5, want[i].size());
    ForwardInput in{batch_.ids, batch_.lens, jobs[i].layers, jobs[i].enc};
    in.outputs = jobs[i].o;
    const absl::Status s = gpu_->ForwardAsync(in, std::span(out.back().get(), want[i].size()),
                                              log.For(static_cast<int>(i)));
    ASSERT_TRUE(s.ok()) << s;
  }
  ASSERT_TRUE(log.WaitFor(jobs.size()));
  EXPECT_TRUE(log.all_ok());
  for (size_t i = 0; i < jobs.size(); ++i) {
    EXPECT_EQ(std::memcmp(out[i].get(), want[i].data(), want[i].size()), 0) << "batch " << i;
    const std::optional<uint64_t> sum = log.checksum(static_cast<int>(i));
    ASSERT_TRUE(sum.has_value()) << "batch " << i;
    EXPECT_EQ(*sum, v1::PayloadChecksum(want[i].data(), want[i].size())) << "batch " << i;
  }
  // A device sink sees whole rows: bytes_per_token is the row's.
  const Job& j = jobs[0];
  ForwardInput in{batch_.ids, batch_.lens, j.layers, j.enc};
  in.outputs = j.o;
  std::vector<std::byte> seen(want[0].size());
  int64_t per_token = 0;
  auto sink = [&](const Engine::DeviceView& v) -> absl::StatusOr<Engine::DeviceWait> {
    per_token = v.bytes_per_token;
    if (v.bytes != seen.size()) return absl::InternalError("view of the wrong size");
    auto stream = static_cast<cudaStream_t>(v.stream);
    if (cudaMemcpyAsync(seen.data(), v.data, v.bytes, cudaMemcpyDeviceToHost, stream) !=
        cudaSuccess) {
      return absl::InternalError("copy");
    }
    return Engine::DeviceWait([stream] {
      Engine::Copied c;
      if (cudaStreamSynchronize(stream) != cudaSuccess) c.status = absl::InternalError("sync");
      return c;
    });
  };
  std::mutex mu;
  std::condition_variable cv;
  bool sent = false;
  absl::Status sent_status;
  ASSERT_TRUE(gpu_->ForwardToDevice(in, sink,
                                    [&](Engine::Copied c) {
                                      std::lock_guard<std::mutex> lock(mu);
                                      sent = true;
                                      sent_status = c.status;
                                      cv.notify_all();
                                    })
                  .ok());
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return sent; }));
  }
  EXPECT_TRUE(sent_status.ok()) << sent_status;
  EXPECT_EQ(per_token, RowBytesPerToken(model_->config, in));
  EXPECT_EQ(seen, want[0]);
}

std::vector<std::string> Models() {
  std::vector<std::string> m = {"tiny-random", "tiny-random-qwen3", "tiny-random-moe",
                                "tiny-random-qwen3-moe"};
  for (const char* dir : {"qwen35_text", "qwen35_mm", "qwen3", "qwen35_moe", "qwen3_moe",
                          "qwen35_text_fp8", "qwen3_fp8", "qwen35_moe_fp8", "qwen3_moe_fp8"}) {
    m.push_back((testing::TestDataDir() / "models" / dir).string());
  }
  return m;
}

std::string ModelName(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = info.param.substr(info.param.find_last_of('/') + 1);
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(Models, CudaTargetOutputsTest, ::testing::ValuesIn(Models()), ModelName);

}  // namespace
}  // namespace draftfeed
