// StageParallel / ReadFilesRaw / MappedFile on the host: how copies are cut
// into chunks and in what order one reader stages them, that every staged
// byte equals its source (memory, a mapped file read with pread, a computed
// copy), that a buffer is never refilled before its transfer was waited for,
// and the errors: a checkpoint truncated after it was mapped names the file.
// ReadToHost (the loader's expert stacking) reads in place.
#include "server/model/staged_read.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <tuple>

#include "server/model/model.h"
#include "server/model/safetensors.h"

namespace draftfeed {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::vector<std::byte> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng());
  return out;
}

// A sink whose "device" is host memory: each chunk is copied to its dst on
// Consume. It records the chunks and checks the buffer discipline: a buffer
// handed out for refilling must have been released by Reuse since its last
// Consume.
class HostSink : public StagingSink {
 public:
  struct Seen {
    size_t copy, offset, bytes;
    int worker, slot;
  };

  absl::Status Prepare(int workers, int slots, size_t chunk_bytes) override {
    slots_ = slots;
    chunk_bytes_ = chunk_bytes;
    buffers_.assign(static_cast<size_t>(workers * slots), std::vector<std::byte>(chunk_bytes));
    in_flight_.assign(buffers_.size(), false);
    finished_.assign(static_cast<size_t>(workers), false);
    return absl::OkStatus();
  }
  std::byte* Buffer(int worker, int slot) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (in_flight_[Index(worker, slot)]) ++refilled_in_flight_;
    return buffers_[Index(worker, slot)].data();
  }
  absl::Status Reuse(int worker, int slot) override {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_[Index(worker, slot)] = false;
    return absl::OkStatus();
  }
  absl::Status Consume(const StagedChunk& c) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (c.staged != buffers_[Index(c.worker, c.slot)].data() || c.bytes > chunk_bytes_) {
      return absl::InternalError("chunk not in its own buffer");
    }
    if (fail_at_ >= 0 && seen_.size() == static_cast<size_t>(fail_at_)) {
      return absl::UnavailableError("sink failed on purpose");
    }
    std::memcpy(c.dst, c.staged, c.bytes);
    in_flight_[Index(c.worker, c.slot)] = true;
    seen_.push_back({c.copy, c.offset, c.bytes, c.worker, c.slot});
    return absl::OkStatus();
  }
  absl::Status Finish(int worker) override {
    std::lock_guard<std::mutex> lock(mu_);
    finished_[static_cast<size_t>(worker)] = true;
    return absl::OkStatus();
  }

  std::vector<Seen> seen_;
  int refilled_in_flight_ = 0;
  int fail_at_ = -1;
  std::vector<bool> finished_;

 private:
  size_t Index(int worker, int slot) const { return static_cast<size_t>(worker * slots_ + slot); }
  std::mutex mu_;
  int slots_ = 1;
  size_t chunk_bytes_ = 0;
  std::vector<std::vector<std::byte>> buffers_;
  std::vector<bool> in_flight_;
};

class StagedReadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::path(::testing::TempDir()) / "staged_read_test" / info->name();
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  fs::path root_;
};

TEST_F(StagedReadTest, OneReaderStagesChunksInCopyOrderAndEveryByteOnce) {
  constexpr size_t kChunk = 4096;
  const std::vector<size_t> sizes = {0, 1, kChunk, kChunk + 1, 3 * kChunk + 5, 77};
  std::vector<std::vector<std::byte>> src, dst;
  std::vector<StagedCopy> copies;
  for (size_t i = 0; i < sizes.size(); ++i) {
    src.push_back(RandomBytes(sizes[i], i));
    dst.emplace_back(sizes[i], std::byte{0xEE});
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    copies.push_back({.src = src[i].data(), .bytes = sizes[i], .dst = dst[i].data()});
  }
  HostSink sink;
  StagedReadOptions opt;
  opt.threads = 1;
  opt.chunk_bytes = kChunk;
  absl::StatusOr<StagedReadStats> stats = StageParallel(copies, {}, opt, sink);
  ASSERT_TRUE(stats.ok()) << stats.status();

  // Copy by copy, offset by offset; the empty copy has no chunk.
  std::vector<std::tuple<size_t, size_t, size_t>> want = {
      {1, 0, 1},      {2, 0, kChunk},      {3, 0, kChunk},          {3, kChunk, 1},
      {4, 0, kChunk}, {4, kChunk, kChunk}, {4, 2 * kChunk, kChunk}, {4, 3 * kChunk, 5},
      {5, 0, 77}};
  ASSERT_EQ(sink.seen_.size(), want.size());
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_EQ(std::make_tuple(sink.seen_[k].copy, sink.seen_[k].offset, sink.seen_[k].bytes),
              want[k])
        << "chunk " << k;
    EXPECT_EQ(sink.seen_[k].slot, static_cast<int>(k % 2)) << "double-buffered in turn";
  }
  EXPECT_EQ(stats->chunks, want.size());
  EXPECT_EQ(stats->threads, 1);
  EXPECT_EQ(stats->bytes, 1 + kChunk + kChunk + 1 + 3 * kChunk + 5 + 77);
  EXPECT_EQ(stats->file_bytes, 0u);
  EXPECT_EQ(sink.refilled_in_flight_, 0);
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(dst[i], src[i]) << "copy " << i;
}

TEST_F(StagedReadTest, ManyReadersStageMappedFilesMemoryAndComputedCopiesBitExactly) {
  // A file of two ranges, mapped as the loader maps a shard (plain bytes: the
  // reader does not care what the file is, and this test runs under TSan,
  // where Debian's protobuf cannot parse a safetensors header).
  const std::vector<std::byte> a = RandomBytes(5 * 8192 + 6, 11), b = RandomBytes(8192, 12);
  const std::string path = (root_ / "shard.bin").string();
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite("header..", 1, 8, f), 8u);
    ASSERT_EQ(std::fwrite(a.data(), 1, a.size(), f), a.size());
    ASSERT_EQ(std::fwrite(b.data(), 1, b.size(), f), b.size());
    std::fclose(f);
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  absl::StatusOr<std::shared_ptr<const MappedFile>> file =
      MappedFile::Map(fd, path, 8 + a.size() + b.size());
  ASSERT_TRUE(file.ok()) << file.status();
  const struct {
    const std::byte* data;
    size_t nbytes;
  } ta{(*file)->data() + 8, a.size()}, tb{(*file)->data() + 8 + a.size(), b.size()};
  const std::vector<std::byte> mem = RandomBytes(100000, 13);
  const std::vector<std::byte> computed = RandomBytes(3 * 4096 + 10, 14);
  std::atomic<int> made{0};

  std::vector<std::byte> da(a.size()), db(b.size()), dm(mem.size()), dc(computed.size());
  std::vector<StagedCopy> copies = {
      {.src = ta.data, .bytes = ta.nbytes, .dst = da.data()},
      {.src = mem.data(), .bytes = mem.size(), .dst = dm.data()},
      ComputedCopy(computed.size(), dc.data(),
                   [&] {
                     ++made;
                     return computed;
                   }),
      {.src = tb.data, .bytes = tb.nbytes, .dst = db.data()},
  };
  const std::vector<std::shared_ptr<const MappedFile>> files = {*file};
  HostSink sink;
  StagedReadOptions opt;
  opt.threads = 4;
  opt.chunk_bytes = 4096;
  absl::StatusOr<StagedReadStats> stats = StageParallel(copies, files, opt, sink);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(da, a);
  EXPECT_EQ(db, b);
  EXPECT_EQ(dm, mem);
  EXPECT_EQ(dc, computed);
  EXPECT_EQ(made.load(), 1) << "a computed copy is made once for all its chunks";
  EXPECT_EQ(stats->file_bytes, a.size() + b.size()) << "the mapped ranges are preads";
  EXPECT_EQ(stats->threads, 4);
  EXPECT_EQ(sink.refilled_in_flight_, 0);
  std::set<std::pair<size_t, size_t>> once;
  for (const HostSink::Seen& s : sink.seen_) {
    EXPECT_TRUE(once.insert({s.copy, s.offset}).second) << "chunk staged twice";
  }
  EXPECT_EQ(once.size(), stats->chunks);
  EXPECT_EQ(sink.finished_, std::vector<bool>(4, true));

  // The same ranges without the file: memory copies of the mapping, same bytes.
  std::fill(da.begin(), da.end(), std::byte{0});
  HostSink again;
  stats = StageParallel(std::span(copies).first(1), {}, opt, again);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->file_bytes, 0u);
  EXPECT_EQ(da, a);
}

TEST_F(StagedReadTest, FileTruncatedAfterMappingIsAShortReadNamingIt) {
  const std::vector<std::byte> a = RandomBytes(64 * 1024, 21);
  const std::string path = (root_ / "model-00002-of-00002.safetensors").string();
  ASSERT_TRUE(WriteSafetensors(
                  path, {{"a", "U8", {static_cast<int64_t>(a.size())}, a.data(), a.size()}}, {})
                  .ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const SafetensorsTensor& t = *file->Find("a");
  // Rewritten shorter in place after the loader checked it (a copy still running, a full disk).
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(fs::file_size(path) - 1000)), 0);
  std::vector<std::byte> dst(t.nbytes);
  const std::vector<StagedCopy> copies = {{.src = t.data, .bytes = t.nbytes, .dst = dst.data()}};
  const std::vector<std::shared_ptr<const MappedFile>> files = {file->file()};
  HostSink sink;
  StagedReadOptions opt;
  opt.threads = 3;
  opt.chunk_bytes = 8192;
  absl::StatusOr<StagedReadStats> stats = StageParallel(copies, files, opt, sink);
  ASSERT_FALSE(stats.ok());
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(stats.status().message(), HasSubstr("short read of " + path));
  EXPECT_THAT(stats.status().message(), HasSubstr("truncated"));
  EXPECT_EQ(sink.finished_, std::vector<bool>(3, true)) << "every reader waits for its copies";
}

TEST_F(StagedReadTest, SinkErrorStopsTheReadersAndIsReturned) {
  const std::vector<std::byte> src = RandomBytes(40 * 4096, 31);
  std::vector<std::byte> dst(src.size());
  const std::vector<StagedCopy> copies = {
      {.src = src.data(), .bytes = src.size(), .dst = dst.data()}};
  HostSink sink;
  sink.fail_at_ = 3;
  StagedReadOptions opt;
  opt.threads = 2;
  opt.chunk_bytes = 4096;
  absl::StatusOr<StagedReadStats> stats = StageParallel(copies, {}, opt, sink);
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(stats.status().message(), HasSubstr("sink failed on purpose"));
  EXPECT_LT(sink.seen_.size(), 40u);
}

TEST_F(StagedReadTest, BadOptionsAndSourcelessCopiesAreRefused) {
  std::vector<std::byte> dst(10);
  HostSink sink;
  StagedReadOptions opt;
  opt.chunk_bytes = 1000;
  const std::vector<std::byte> src(10);
  const std::vector<StagedCopy> copies = {{.src = src.data(), .bytes = 10, .dst = dst.data()}};
  EXPECT_THAT(StageParallel(copies, {}, opt, sink).status().message(),
              HasSubstr("chunk_bytes must be a positive multiple of 4096, got 1000"));
  opt.chunk_bytes = 4096;
  opt.slots_per_thread = 0;
  EXPECT_THAT(StageParallel(copies, {}, opt, sink).status().message(),
              HasSubstr("slots_per_thread must be >= 1"));
  opt.slots_per_thread = 2;
  opt.threads = -1;
  EXPECT_THAT(StageParallel(copies, {}, opt, sink).status().message(),
              HasSubstr("threads must be >= 0"));
  opt.threads = 0;
  const std::vector<StagedCopy> sourceless = {{.src = nullptr, .bytes = 10, .dst = dst.data()}};
  EXPECT_THAT(StageParallel(sourceless, {}, opt, sink).status().message(),
              HasSubstr("copy 0 of 10 bytes has no source"));
  EXPECT_GE(DefaultReadThreads(), 1);
  EXPECT_LE(DefaultReadThreads(), 8);
}

TEST_F(StagedReadTest, LoadedCheckpointNamesItsFilesAndItsTensorsReadBackExactly) {
  absl::StatusOr<std::unique_ptr<Model>> src = MakeRandomModel("tiny-random:3");
  ASSERT_TRUE(src.ok()) << src.status();
  HfWriteOptions w;
  w.num_shards = 3;
  ASSERT_TRUE(WriteHfCheckpoint(**src, root_.string(), w).ok());
  absl::StatusOr<std::unique_ptr<Model>> model = LoadModel(root_.string());
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ((*model)->files.size(), 3u);
  std::set<std::string> names;
  for (const auto& f : (*model)->files) names.insert(fs::path(f->path()).filename().string());
  EXPECT_THAT(names, ::testing::ElementsAre("model-00001-of-00003.safetensors",
                                            "model-00002-of-00003.safetensors",
                                            "model-00003-of-00003.safetensors"));

  // Every decoder tensor lies in one of them and stages to the bytes the mapping shows.
  std::vector<StagedCopy> copies;
  std::vector<std::vector<std::byte>> dst;
  std::vector<const Tensor*> tensors;
  const Tensor* embed = &(*model)->weights.embed_tokens;
  tensors.push_back(embed);
  for (const LayerWeights& l : (*model)->weights.layers) {
    for (const Tensor* t : {&l.input_layernorm, &l.q_proj, &l.in_proj_qkv, &l.down_proj}) {
      if (t->valid()) tensors.push_back(t);
    }
  }
  dst.reserve(tensors.size());
  for (const Tensor* t : tensors) {
    dst.emplace_back(t->nbytes());
    copies.push_back({.src = t->data, .bytes = t->nbytes(), .dst = dst.back().data()});
  }
  HostSink sink;
  StagedReadOptions opt;
  opt.threads = 3;
  opt.chunk_bytes = 4096;
  absl::StatusOr<StagedReadStats> stats = StageParallel(copies, (*model)->files, opt, sink);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->file_bytes, stats->bytes);
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(std::memcmp(dst[i].data(), tensors[i]->data, dst[i].size()), 0) << "tensor " << i;
  }
}

TEST_F(StagedReadTest, ReadToHostReadsStraightIntoTheDestinations) {
  const std::vector<std::byte> a = RandomBytes(7 * 4096 + 3, 51), mem = RandomBytes(5000, 52);
  const std::string path = (root_ / "experts.safetensors").string();
  ASSERT_TRUE(WriteSafetensors(
                  path, {{"a", "U8", {static_cast<int64_t>(a.size())}, a.data(), a.size()}}, {})
                  .ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const SafetensorsTensor& t = *file->Find("a");
  // Two parts of the file and one of memory, stacked back to back.
  std::vector<std::byte> stacked(a.size() + mem.size() + 100);
  const size_t half = 3 * 4096 + 1;
  const std::vector<StagedCopy> copies = {
      {.src = t.data + half, .bytes = a.size() - half, .dst = stacked.data()},
      {.src = mem.data(), .bytes = mem.size(), .dst = stacked.data() + a.size() - half},
      {.src = t.data, .bytes = half, .dst = stacked.data() + a.size() - half + mem.size()},
  };
  StagedReadOptions opt;
  opt.threads = 3;
  opt.chunk_bytes = 4096;
  const std::vector<std::shared_ptr<const MappedFile>> files = {file->file()};
  absl::StatusOr<StagedReadStats> stats = ReadToHost(copies, files, opt);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->file_bytes, a.size());
  std::vector<std::byte> want(a.begin() + half, a.end());
  want.insert(want.end(), mem.begin(), mem.end());
  want.insert(want.end(), a.begin(), a.begin() + half);
  want.resize(stacked.size());
  EXPECT_EQ(stacked, want);

  const std::vector<StagedCopy> nowhere = {{.src = mem.data(), .bytes = 8, .dst = nullptr}};
  EXPECT_THAT(ReadToHost(nowhere, {}, opt).status().message(),
              HasSubstr("copy 0 of 8 bytes has no dst"));
}

TEST_F(StagedReadTest, ReadFilesRawReadsEveryByteAndNamesAMissingFile) {
  const std::vector<std::byte> a = RandomBytes(3 * 4096 + 1, 41);
  std::vector<std::string> paths;
  for (int i = 0; i < 3; ++i) {
    paths.push_back((root_ / ("f" + std::to_string(i))).string());
    std::FILE* f = std::fopen(paths.back().c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(a.data(), 1, a.size() - static_cast<size_t>(i), f), a.size() - i);
    std::fclose(f);
  }
  StagedReadOptions opt;
  opt.threads = 2;
  opt.chunk_bytes = 4096;
  absl::StatusOr<StagedReadStats> stats = ReadFilesRaw(paths, opt);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->bytes, 3 * a.size() - 3);
  EXPECT_EQ(stats->file_bytes, stats->bytes);
  EXPECT_EQ(stats->chunks, 10u);  // 4 + 3 + 3: the sizes are 3 pages + 1, + 0, - 1

  // Just read: resident (as far as the page cache can tell; 1.0 on any file system).
  absl::StatusOr<double> resident = ResidentFraction(paths[0]);
  ASSERT_TRUE(resident.ok()) << resident.status();
  EXPECT_EQ(*resident, 1.0);
  ASSERT_TRUE(EvictFromPageCache(paths[0]).ok());
  resident = ResidentFraction(paths[0]);
  ASSERT_TRUE(resident.ok()) << resident.status();
  EXPECT_GE(*resident, 0.0);
  EXPECT_LE(*resident, 1.0);

  const std::string missing = (root_ / "nope.safetensors").string();
  EXPECT_THAT(ReadFilesRaw({paths[0], missing}, opt).status().message(),
              HasSubstr("cannot open " + missing));
  EXPECT_THAT(EvictFromPageCache(missing).message(), HasSubstr(missing));
  EXPECT_THAT(ResidentFraction(missing).status().message(), HasSubstr(missing));
}

}  // namespace
}  // namespace draftfeed
