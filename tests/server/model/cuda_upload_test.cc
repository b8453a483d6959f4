// UploadToDevice and the CUDA engine's staged weight upload (skip without a
// GPU): the device bytes equal the host ranges bit for bit, whatever the
// source (a mapped checkpoint read with pread, plain memory, a computed
// copy), the thread count and the chunk size; and an engine made from a
// checkpoint on disk computes exactly what one made from the same weights in
// memory does, with one reader and whole chunks or with many readers and
// chunks smaller than most tensors, from bf16 or f32 files, dense, MoE saved
// per expert, and FP8 (e4m3 bytes read as they are, block scales computed
// into the GEMM's layout).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include "absl/strings/str_cat.h"
#include "server/model/cuda_engine.h"
#include "server/model/cuda_upload.h"
#include "server/model/model.h"
#include "server/model/safetensors.h"

namespace draftfeed {
namespace {

namespace fs = std::filesystem;

bool HasGpu() { return CudaDeviceCount() > 0; }

std::vector<std::byte> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng());
  return out;
}

fs::path TestDir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path root = fs::path(::testing::TempDir()) / "cuda_upload_test" / info->name();
  fs::remove_all(root);
  fs::create_directories(root);
  return root;
}

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t n) { cudaMalloc(&p, n); }
  ~DeviceBuffer() { cudaFree(p); }
};

std::vector<std::byte> ReadBack(const void* d, size_t n) {
  std::vector<std::byte> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), d, n, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

TEST(CudaUploadTest, DeviceBytesEqualTheHostRangesForEverySource) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  const fs::path root = TestDir();
  const std::vector<std::byte> a = RandomBytes(3 * 65536 + 2, 1), b = RandomBytes(4096, 2);
  const std::string path = (root / "shard.safetensors").string();
  ASSERT_TRUE(WriteSafetensors(path,
                               {{"a", "U8", {static_cast<int64_t>(a.size())}, a.data(), a.size()},
                                {"b", "U8", {static_cast<int64_t>(b.size())}, b.data(), b.size()}},
                               {})
                  .ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const std::vector<std::byte> mem = RandomBytes(1 << 20, 3), made = RandomBytes(70001, 4);
  const std::vector<std::shared_ptr<const MappedFile>> files = {file->file()};

  for (const auto& [threads, chunk] :
       {std::pair{1, size_t{16} << 20}, std::pair{5, size_t{4096}}, std::pair{3, size_t{65536}}}) {
    SCOPED_TRACE(::testing::Message() << threads << " threads, chunks of " << chunk);
    DeviceBuffer da(a.size()), db(b.size()), dm(mem.size()), dc(made.size());
    const SafetensorsTensor& ta = *file->Find("a");
    const SafetensorsTensor& tb = *file->Find("b");
    const std::vector<StagedCopy> copies = {
        {.src = ta.data, .bytes = ta.nbytes, .dst = da.p},
        {.src = mem.data(), .bytes = mem.size(), .dst = dm.p},
        ComputedCopy(made.size(), dc.p, [&] { return made; }),
        {.src = tb.data, .bytes = tb.nbytes, .dst = db.p},
    };
    StagedReadOptions opt;
    opt.threads = threads;
    opt.chunk_bytes = chunk;
    absl::StatusOr<StagedReadStats> stats = UploadToDevice(copies, files, 0, opt, "cuda:0");
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->file_bytes, a.size() + b.size());
    EXPECT_EQ(ReadBack(da.p, a.size()), a);
    EXPECT_EQ(ReadBack(db.p, b.size()), b);
    EXPECT_EQ(ReadBack(dm.p, mem.size()), mem);
    EXPECT_EQ(ReadBack(dc.p, made.size()), made);
  }
}

TEST(CudaUploadTest, TruncatedCheckpointFailsNamingTheFile) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  const fs::path root = TestDir();
  const std::vector<std::byte> a = RandomBytes(1 << 20, 5);
  const std::string path = (root / "model.safetensors").string();
  ASSERT_TRUE(WriteSafetensors(
                  path, {{"a", "U8", {static_cast<int64_t>(a.size())}, a.data(), a.size()}}, {})
                  .ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  fs::resize_file(path, 4096);
  DeviceBuffer d(a.size());
  const SafetensorsTensor& t = *file->Find("a");
  const std::vector<StagedCopy> copies = {{.src = t.data, .bytes = t.nbytes, .dst = d.p}};
  const std::vector<std::shared_ptr<const MappedFile>> files = {file->file()};
  absl::StatusOr<StagedReadStats> stats = UploadToDevice(copies, files, 0, {}, "cuda:0");
  ASSERT_FALSE(stats.ok());
  EXPECT_NE(stats.status().message().find("short read of " + path), std::string::npos)
      << stats.status();
}

// The capture of every layer for one packed batch, as bf16 bits.
std::vector<uint16_t> Capture(const Model& model, int threads, size_t chunk) {
  CudaEngineOptions opt;
  opt.max_tokens = 256;
  opt.max_seqs = 8;
  opt.load_threads = threads;
  opt.load_chunk_bytes = chunk;
  auto engine = CudaEngine::Create(&model, opt);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return {};
  const ModelConfig& c = model.config;
  const std::vector<int32_t> lens = {5, 60, 31};
  std::vector<int32_t> ids(96);
  std::mt19937_64 rng(9);
  for (auto& t : ids) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(c.vocab_size));
  std::vector<int32_t> layers;
  for (int32_t i = 0; i < c.num_layers; ++i) layers.push_back(i);
  layers.push_back(kFinalLayerId);
  std::vector<uint16_t> out(ids.size() * layers.size() * static_cast<size_t>(c.hidden_size));
  const absl::Status s =
      (*engine)->Forward({ids, lens, layers}, std::as_writable_bytes(std::span(out)));
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

TEST(CudaUploadTest, EngineFromCheckpointFilesComputesWhatTheSameWeightsInMemoryDo) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  const fs::path root = TestDir();
  for (const char* spec : {"tiny-random:4", "tiny-random-moe:4", "tiny-random-fp8:4"}) {
    SCOPED_TRACE(spec);
    absl::StatusOr<std::unique_ptr<Model>> mem = MakeRandomModel(spec);
    ASSERT_TRUE(mem.ok()) << mem.status();
    const std::vector<uint16_t> want = Capture(**mem, 1, size_t{16} << 20);
    ASSERT_FALSE(want.empty());
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      const std::string dir =
          (root / absl::StrCat(spec, "-", std::string(DTypeName(dtype)))).string();
      HfWriteOptions w;
      w.num_shards = 2;
      w.dtype = dtype;  // f32 files: widened exactly, so narrowed back to the same bf16
      ASSERT_TRUE(WriteHfCheckpoint(**mem, dir, w).ok());
      absl::StatusOr<std::unique_ptr<Model>> disk = LoadModel(dir);
      ASSERT_TRUE(disk.ok()) << disk.status();
      ASSERT_EQ((*disk)->files.size(), 2u);
      EXPECT_EQ(Capture(**disk, 1, size_t{16} << 20), want) << DTypeName(dtype);
      EXPECT_EQ(Capture(**disk, 6, 4096), want) << DTypeName(dtype) << ", small chunks";
    }
  }
}

}  // namespace
}  // namespace draftfeed
