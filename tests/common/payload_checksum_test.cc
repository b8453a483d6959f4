// The BatchDone payload checksum (proto/draftfeed/v1/checksum.h): its pinned
// protocol value, every vectorised path and every way of feeding it against
// the word-by-word reference, what it must notice, and the GPU kernel against
// the same reference (skipped without a GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "common/payload_checksum.h"
#if DRAFTFEED_HAVE_CUDA
#include "kernels/checksum.cuh"
#include "tests/kernels/cuda/gpu_test_util.h"
#endif

namespace draftfeed {
namespace {

std::vector<unsigned char> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> b(n);
  for (auto& x : b) x = static_cast<unsigned char>(rng());
  return b;
}

// Every size near the stripe (64 B) and word (8 B) edges, and a few large ones.
std::vector<size_t> Sizes() {
  std::vector<size_t> sizes;
  for (size_t n = 0; n <= 200; ++n) sizes.push_back(n);
  for (size_t n : {size_t{1023}, size_t{1024}, size_t{1025}, size_t{4099}, size_t{65536 + 13},
                   (size_t{1} << 20) + 7}) {
    sizes.push_back(n);
  }
  return sizes;
}

class ChecksumPath : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!v1::UseChecksumPathForTesting(GetParam())) GTEST_SKIP() << "path not available here";
  }
  void TearDown() override { v1::UseChecksumPathForTesting(0); }
};

TEST_P(ChecksumPath, WholeBufferEqualsReference) {
  for (size_t n : Sizes()) {
    const std::vector<unsigned char> b = RandomBytes(n, n + 1);
    EXPECT_EQ(v1::PayloadChecksum(b.data(), n), v1::PayloadChecksumReference(b.data(), n))
        << n << " bytes";
  }
}

TEST_P(ChecksumPath, PiecesAndCopiesEqualReference) {
  const std::vector<unsigned char> b = RandomBytes(4099, 7);
  for (size_t n : {size_t{0}, size_t{5}, size_t{64}, size_t{100}, size_t{4099}}) {
    const uint64_t want = v1::PayloadChecksumReference(b.data(), n);
    for (size_t piece :
         {size_t{1}, size_t{7}, size_t{8}, size_t{63}, size_t{64}, size_t{65}, size_t{1000}}) {
      v1::PayloadHasher hashed, copied;
      std::vector<unsigned char> dst(n + 1, 0xee);
      for (size_t off = 0; off < n; off += piece) {
        const size_t len = std::min(piece, n - off);
        hashed.Update(b.data() + off, len);
        copied.CopyAndUpdate(dst.data() + off, b.data() + off, len);
      }
      EXPECT_EQ(hashed.Finish(), want) << n << " bytes in pieces of " << piece;
      EXPECT_EQ(copied.Finish(), want) << n << " bytes copied in pieces of " << piece;
      EXPECT_EQ(copied.bytes_seen(), n);
      EXPECT_TRUE(std::equal(b.begin(), b.begin() + static_cast<ptrdiff_t>(n), dst.begin()));
      EXPECT_EQ(dst[n], 0xee) << "wrote past the end";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, ChecksumPath, ::testing::Values(0, 1, 2), [](const auto& info) {
  return std::string(info.param == 0 ? "Auto" : info.param == 1 ? "Sse2" : "Avx2");
});

TEST(Checksum, PinnedProtocolValue) {
  // Part of the protocol: a change here breaks every older client.
  std::vector<unsigned char> b(1000);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<unsigned char>(i * 7 + 3);
  EXPECT_EQ(v1::PayloadChecksumReference(b.data(), b.size()), 0x21cbf3d2a14be62bULL);
  EXPECT_EQ(v1::PayloadChecksum(b.data(), b.size()), 0x21cbf3d2a14be62bULL);
}

TEST(Checksum, SeesEveryBitAndEveryMove) {
  std::vector<unsigned char> b = RandomBytes(4096 + 5, 1);
  const uint64_t base = v1::PayloadChecksum(b.data(), b.size());
  for (size_t byte : {size_t{0}, size_t{3}, size_t{4}, size_t{7}, size_t{8}, size_t{2048},
                      size_t{4095}, b.size() - 1}) {
    for (int bit = 0; bit < 8; ++bit) {
      b[byte] ^= static_cast<unsigned char>(1u << bit);
      EXPECT_NE(v1::PayloadChecksum(b.data(), b.size()), base) << byte << ":" << bit;
      b[byte] ^= static_cast<unsigned char>(1u << bit);
    }
  }
  // Neighbouring words (two lanes), the same lane of two stripes, and two whole
  // stripes swapped: reassembly at the wrong offset must show.
  for (auto [from, to, len] : {std::tuple{0, 8, 8}, std::tuple{0, 64, 8}, std::tuple{0, 640, 64}}) {
    std::vector<unsigned char> moved = b;
    std::swap_ranges(moved.begin() + from, moved.begin() + from + len, moved.begin() + to);
    EXPECT_NE(v1::PayloadChecksum(moved.data(), moved.size()), base) << from << "<->" << to;
  }
  // All-zero payloads of different lengths differ: trailing zeros are not free.
  std::vector<unsigned char> zeros(4096, 0);
  EXPECT_NE(v1::PayloadChecksum(zeros.data(), 4096), v1::PayloadChecksum(zeros.data(), 4095));
  b.push_back(0);
  EXPECT_NE(v1::PayloadChecksum(b.data(), b.size()), base);
}

#if DRAFTFEED_HAVE_CUDA
TEST(Checksum, GpuKernelEqualsReference) {
  DF_REQUIRE_GPU();
  unsigned long long* scratch = nullptr;
  uint64_t* lanes = nullptr;
  DF_CUDA_OK(cudaMalloc(&scratch, 8 * sizeof(*scratch)));
  DF_CUDA_OK(cudaMallocHost(&lanes, 8 * sizeof(*lanes)));
  std::vector<size_t> sizes = Sizes();
  sizes.push_back((size_t{64} << 20) + 5);
  for (size_t n : sizes) {
    const std::vector<unsigned char> b = RandomBytes(n, n);
    void* d = nullptr;
    DF_CUDA_OK(cudaMalloc(&d, std::max<size_t>(n, 1)));
    DF_CUDA_OK(cudaMemcpy(d, b.data(), n, cudaMemcpyHostToDevice));
    uint64_t sum = 0;
    DF_CUDA_OK(cuda::PayloadChecksum(d, n, scratch, lanes, &sum, nullptr));
    EXPECT_EQ(sum, v1::PayloadChecksumReference(b.data(), n)) << n << " bytes";
    cudaFree(d);
  }
  // Misaligned device data is refused, not read wrongly.
  void* d = nullptr;
  DF_CUDA_OK(cudaMalloc(&d, 64));
  uint64_t sum = 0;
  EXPECT_EQ(cuda::PayloadChecksum(static_cast<char*>(d) + 8, 32, scratch, lanes, &sum, nullptr),
            cudaErrorMisalignedAddress);
  cudaFree(d);
  cudaFree(scratch);
  cudaFreeHost(lanes);
}
#endif

}  // namespace
}  // namespace draftfeed
