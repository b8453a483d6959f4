// The CUDA engine's fp8_e4m3 capture (skips without a GPU): Forward(fp8) is
// the host encoder over Forward(bf16)'s capture, bit for bit (the engine
// encodes its bf16 capture on the GPU), so it decodes to within half an e4m3
// step of the bf16 states; ForwardAsync's GPU checksum covers the fp8 bytes;
// ForwardToDevice hands a sink the fp8 payload. Bit-for-bit comparisons
// across forwards need a deterministic forward: the dense one is (asserted);
// where the MoE one is not, those checks fall back to bounds.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/fp8_capture.h"
#include "common/host_buffer_pool.h"
#include "common/payload_checksum.h"
#include "server/model/cuda_engine.h"
#include "server/model/tensor.h"

namespace draftfeed {
namespace {

struct Batch {
  std::vector<int32_t> ids, lens;
};

class CudaEngineFp8Test : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    auto model = OpenModel(GetParam());
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *std::move(model);
    CudaEngineOptions opt;
    opt.max_tokens = 1024;
    opt.max_layers = 3;
    auto gpu = CudaEngine::Create(model_.get(), opt);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = *std::move(gpu);
    std::mt19937_64 rng(9);
    batch_.lens = {1, 63, 200, 7};
    for (int32_t l : batch_.lens) {
      for (int32_t i = 0; i < l; ++i) {
        batch_.ids.push_back(static_cast<int32_t>(rng() % model_->config.vocab_size));
      }
    }
  }
  ForwardInput In(CaptureEncoding e) const { return {batch_.ids, batch_.lens, layers_, e}; }
  // Forward(fp8) twice: the bytes, and whether the two runs agreed (the MoE
  // forward may reorder tokens within an expert, and then other paths can
  // only be checked for consistency with themselves).
  std::vector<std::byte> Fp8Twice(bool* deterministic) {
    std::vector<std::byte> a = Forward(CaptureEncoding::kFp8E4m3);
    *deterministic = Forward(CaptureEncoding::kFp8E4m3) == a;
    return a;
  }
  // Every scale positive and finite: the layout is read where it was written.
  void ExpectScalesValid(const std::vector<std::byte>& fp8) const {
    for (int64_t t = 0; t < T(); ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const float s = Fp8CaptureScale(fp8.data(), K, H(), t, k);
        ASSERT_TRUE(std::isfinite(s) && s > 0) << t << "," << k << ": " << s;
      }
    }
  }
  std::vector<std::byte> Forward(CaptureEncoding e) {
    std::vector<std::byte> out(CaptureBytes(model_->config, In(e)));
    const absl::Status s = gpu_->Forward(In(e), out);
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }
  int64_t T() const { return static_cast<int64_t>(batch_.ids.size()); }
  int64_t H() const { return model_->config.hidden_size; }

  std::unique_ptr<Model> model_;
  std::unique_ptr<CudaEngine> gpu_;
  Batch batch_;
  const std::vector<int32_t> layers_ = {0, 1, kFinalLayerId};
  static constexpr int64_t K = 3;
};

double Rms(const std::vector<float>& a, const std::vector<float>& b) {
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
  return std::sqrt(sum / static_cast<double>(a.size()));
}

std::vector<float> Widen(const std::vector<std::byte>& bf16) {
  std::vector<uint16_t> bits(bf16.size() / 2);
  std::memcpy(bits.data(), bf16.data(), bf16.size());
  std::vector<float> f(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) f[i] = Bf16ToFloat(bits[i]);
  return f;
}

TEST_P(CudaEngineFp8Test, ForwardIsTheHostEncoderOverTheBf16Capture) {
  const std::vector<CaptureEncoding> served = gpu_->encodings();
  EXPECT_NE(std::find(served.begin(), served.end(), CaptureEncoding::kFp8E4m3), served.end());
  const std::vector<std::byte> bf16 = Forward(CaptureEncoding::kBf16);
  const std::vector<std::byte> fp8 = Forward(CaptureEncoding::kFp8E4m3);
  const std::vector<std::byte> bf16_again = Forward(CaptureEncoding::kBf16);
  ASSERT_EQ(fp8.size(), static_cast<size_t>(T() * (K * H() + 4 * K)));
  std::vector<uint16_t> bits(bf16.size() / 2);
  std::memcpy(bits.data(), bf16.data(), bf16.size());
  std::vector<std::byte> want(fp8.size());
  ASSERT_TRUE(EncodeFp8CaptureBf16(bits, T(), K, H(), want).ok());
  std::vector<float> got(bits.size()), host(bits.size());
  ASSERT_TRUE(DecodeFp8CaptureToFloat(fp8, T(), K, H(), got).ok());
  ASSERT_TRUE(DecodeFp8CaptureToFloat(want, T(), K, H(), host).ok());
  const std::vector<float> x = Widen(bf16);

  // The dense forward is deterministic run to run (as the async tests rely
  // on); the MoE one may reorder tokens within an expert.
  const bool deterministic = bf16 == bf16_again;
  if (std::string(GetParam()) == "small-random") {
    EXPECT_TRUE(deterministic);
  }
  if (!deterministic) {
    // The GPU encoding of its own forward is as far from a bf16 forward as
    // the host encoding is, plus the forwards' own difference.
    const double run_to_run = Rms(Widen(bf16_again), x);
    EXPECT_LE(Rms(got, x), 1.05 * Rms(host, x) + 2 * run_to_run) << GetParam();
    return;
  }
  EXPECT_EQ(fp8, want);
  // Which is within half an e4m3 step (at the row's scale) of the bf16 states.
  double worst = 0;
  for (int64_t t = 0; t < T(); ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const double s = Fp8CaptureScale(fp8.data(), K, H(), t, k);
      for (int64_t i = 0; i < H(); ++i) {
        const size_t j = static_cast<size_t>((t * K + k) * H() + i);
        const double bound =
            std::max(std::fabs(double{x[j]}) / 16, 0x1p-10 * s) + 0x1p-22 * std::fabs(x[j]);
        ASSERT_LE(std::fabs(got[j] - x[j]), bound) << t << "," << k << "," << i;
        worst = std::max(worst, std::fabs(got[j] - x[j]) / bound);
      }
    }
  }
  EXPECT_GT(worst, 0.5);  // rounding happened: the payload is not a copy
}

TEST_P(CudaEngineFp8Test, AsyncCopyChecksumsTheFp8Bytes) {
  bool deterministic = false;
  const std::vector<std::byte> want = Fp8Twice(&deterministic);
  HostBufferPool pinned(0, PinnedHostAllocator());
  std::shared_ptr<std::byte> out = pinned.Acquire(want.size());
  ASSERT_NE(out, nullptr);
  std::mutex mu;
  std::condition_variable cv;
  std::optional<Engine::Copied> copied;
  absl::Status s =
      gpu_->ForwardAsync(In(CaptureEncoding::kFp8E4m3),
                         std::span<std::byte>(out.get(), want.size()), [&](Engine::Copied c) {
                           std::lock_guard<std::mutex> lock(mu);
                           copied = std::move(c);
                           cv.notify_all();
                         });
  ASSERT_TRUE(s.ok()) << s;
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return copied.has_value(); }));
  ASSERT_TRUE(copied->status.ok()) << copied->status;
  const std::vector<std::byte> got(out.get(), out.get() + want.size());
  if (deterministic) {
    EXPECT_EQ(got, want);
  }
  ExpectScalesValid(got);
  ASSERT_TRUE(copied->checksum.has_value());
  EXPECT_EQ(*copied->checksum, v1::PayloadChecksum(got.data(), got.size()));
}

TEST_P(CudaEngineFp8Test, DeviceSinkSeesTheFp8Payload) {
  bool deterministic = false;
  const std::vector<std::byte> want = Fp8Twice(&deterministic);
  std::vector<std::byte> seen(want.size());
  Engine::DeviceView view;
  std::mutex mu;
  std::condition_variable cv;
  bool sent = false;
  absl::Status s = gpu_->ForwardToDevice(
      In(CaptureEncoding::kFp8E4m3),
      [&](const Engine::DeviceView& v) -> absl::StatusOr<Engine::DeviceWait> {
        view = v;
        if (v.bytes != seen.size()) return absl::InternalError("view size");
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
      },
      [&](Engine::Copied c) {
        EXPECT_TRUE(c.status.ok()) << c.status;
        std::lock_guard<std::mutex> lock(mu);
        sent = true;
        cv.notify_all();
      });
  ASSERT_TRUE(s.ok()) << s;
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return sent; }));
  EXPECT_EQ(view.encoding, CaptureEncoding::kFp8E4m3);
  EXPECT_EQ(view.bytes_per_token, K * H() + 4 * K);
  if (deterministic) {
    EXPECT_EQ(seen, want);
  }
  ExpectScalesValid(seen);
}

INSTANTIATE_TEST_SUITE_P(DenseAndMoe, CudaEngineFp8Test,
                         ::testing::Values("small-random", "tiny-random-moe"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::erase(name, '-');
                           return name;
                         });

}  // namespace
}  // namespace draftfeed
