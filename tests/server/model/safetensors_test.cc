#include "server/model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace draftfeed {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) / "safetensors_test" / info->name();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // A file whose header is `header` verbatim, `declared_len` in the length
  // field (the real length when negative), then `data_bytes` bytes of data.
  std::string WriteRaw(const std::string& name, const std::string& header, size_t data_bytes,
                       int64_t declared_len = -1) {
    const std::string path = Path(name);
    std::ofstream out(path, std::ios::binary);
    const uint64_t len = declared_len < 0 ? header.size() : static_cast<uint64_t>(declared_len);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(len >> (8 * i)));
    out << header << std::string(data_bytes, '\x11');
    return path;
  }

  std::string OpenError(const std::string& path) {
    auto f = SafetensorsFile::Open(path);
    EXPECT_FALSE(f.ok());
    return f.ok() ? "" : std::string(f.status().message());
  }

  fs::path dir_;
};

template <typename T>
SafetensorsTensor Entry(std::string name, std::string dtype, std::vector<int64_t> shape,
                        const std::vector<T>& values) {
  SafetensorsTensor t;
  t.name = std::move(name);
  t.dtype = std::move(dtype);
  t.shape = std::move(shape);
  t.data = reinterpret_cast<const std::byte*>(values.data());
  t.nbytes = values.size() * sizeof(T);
  return t;
}

template <typename T>
std::vector<T> Values(const SafetensorsTensor& t) {
  std::vector<T> out(t.nbytes / sizeof(T));
  std::memcpy(out.data(), t.data, t.nbytes);
  return out;
}

TEST_F(SafetensorsTest, RoundTrip) {
  const std::vector<uint16_t> bf16 = {0x3f80, 0x4000, 0xbf80, 0x0000, 0x7f80, 0x3e80};  // odd count
  const std::vector<float> f32 = {1.5f, -2.25f, 3.0f, 1e-30f};
  const std::vector<int32_t> i32 = {-7, 0, 2147483647};
  const std::vector<int64_t> i64 = {1ll << 40, -1};
  const std::vector<uint8_t> u8 = {1, 2, 3};
  const std::vector<float> empty;
  const std::string path = Path("rt.safetensors");
  ASSERT_TRUE(
      WriteSafetensors(path,
                       {Entry("a.bf16", "BF16", {2, 3}, bf16), Entry("b.f32", "F32", {4}, f32),
                        Entry("c.i32", "I32", {3}, i32), Entry("d.i64", "I64", {1, 2}, i64),
                        Entry("e.u8", "U8", {3}, u8), Entry("f.empty", "F32", {0, 5}, empty),
                        Entry("g \"quoted\"\\name", "I32", {3}, i32)},
                       {{"format", "pt"}, {"note", "x\"y"}})
          .ok());

  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->path(), path);
  EXPECT_EQ(f->tensors().size(), 7u);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->metadata().at("note"), "x\"y");

  const SafetensorsTensor* a = f->Find("a.bf16");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, "BF16");
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->nbytes, 12u);
  EXPECT_EQ(Values<uint16_t>(*a), bf16);
  EXPECT_EQ(Values<float>(*f->Find("b.f32")), f32);
  EXPECT_EQ(f->Find("c.i32")->dtype, "I32");
  EXPECT_EQ(Values<int32_t>(*f->Find("c.i32")), i32);
  EXPECT_EQ(Values<int64_t>(*f->Find("d.i64")), i64);
  EXPECT_EQ(Values<uint8_t>(*f->Find("e.u8")), u8);
  EXPECT_EQ(f->Find("f.empty")->nbytes, 0u);
  EXPECT_EQ(f->Find("f.empty")->shape, (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(Values<int32_t>(*f->Find("g \"quoted\"\\name")), i32);
  EXPECT_EQ(f->Find("missing"), nullptr);

  // Header padded with spaces so the data section starts 8-aligned.
  std::ifstream in(path, std::ios::binary);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  EXPECT_EQ(header_len % 8, 0u);
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));
  EXPECT_EQ(fs::file_size(path), 8 + header_len + 12 + 16 + 12 + 16 + 3 + 0 + 12);
}

TEST_F(SafetensorsTest, StorageOutlivesFile) {
  const std::vector<float> v = {4.0f, 5.0f};
  const std::string path = Path("keep.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {Entry("w", "F32", {2}, v)}, {}).ok());
  std::shared_ptr<const void> storage;
  const std::byte* data = nullptr;
  {
    auto f = SafetensorsFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_TRUE(f->metadata().empty());
    storage = f->storage();
    data = f->Find("w")->data;
  }
  fs::remove(path);
  float got[2];
  std::memcpy(got, data, sizeof(got));
  EXPECT_EQ(got[1], 5.0f);
}

TEST_F(SafetensorsTest, WriterRejectsInconsistentEntries) {
  const std::vector<float> v = {1, 2, 3};
  auto st = WriteSafetensors(Path("bad.safetensors"), {Entry("w", "F32", {2, 2}, v)}, {});
  EXPECT_EQ(st.message(), "writing " + Path("bad.safetensors") +
                              ": tensor w: shape [2, 2] of F32 is 16 bytes, got 12");
  st = WriteSafetensors(Path("bad.safetensors"), {Entry("w", "Q4", {3}, v)}, {});
  EXPECT_EQ(st.message(),
            "writing " + Path("bad.safetensors") + ": tensor w: unknown dtype \"Q4\"");
  EXPECT_FALSE(fs::exists(Path("bad.safetensors")));
}

TEST_F(SafetensorsTest, MissingFile) {
  auto f = SafetensorsFile::Open(Path("nope.safetensors"));
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(f.status().message(), HasSubstr(Path("nope.safetensors")));
}

TEST_F(SafetensorsTest, TooShortForHeaderLength) {
  const std::string path = Path("short.safetensors");
  std::ofstream(path, std::ios::binary) << "abc";
  EXPECT_EQ(OpenError(path), "safetensors file " + path +
                                 ": file is 3 bytes, too short for the 8-byte header length");
}

TEST_F(SafetensorsTest, HeaderLengthLies) {
  const std::string path =
      WriteRaw("lie.safetensors", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4,
               /*declared_len=*/5000);
  EXPECT_EQ(OpenError(path), "safetensors file " + path +
                                 ": header length 5000 runs past the end of the file (" +
                                 std::to_string(fs::file_size(path)) + " bytes)");
  const std::string huge = WriteRaw("huge.safetensors", "{}", 0, int64_t{1} << 40);
  EXPECT_EQ(OpenError(huge), "safetensors file " + huge + ": header length " +
                                 std::to_string(int64_t{1} << 40) +
                                 " exceeds the 104857600-byte limit");
}

TEST_F(SafetensorsTest, TruncatedData) {
  const std::vector<float> x(4, 1.0f), w(12, 2.0f);
  const std::string path = Path("trunc.safetensors");
  ASSERT_TRUE(
      WriteSafetensors(path, {Entry("x", "F32", {4}, x), Entry("layer.w", "F32", {12}, w)}, {})
          .ok());
  fs::resize_file(path, fs::file_size(path) - 10);
  EXPECT_EQ(OpenError(path), "safetensors file " + path +
                                 ": tensor layer.w: data_offsets [16, 64] run past the end of the "
                                 "data section (54 bytes; file truncated?)");
}

TEST_F(SafetensorsTest, OffsetsBeyondData) {
  const std::string path =
      WriteRaw("beyond.safetensors",
               R"({"w.weight":{"dtype":"BF16","shape":[2,4],"data_offsets":[8,24]}})", 16);
  EXPECT_EQ(OpenError(path), "safetensors file " + path +
                                 ": tensor w.weight: data_offsets [8, 24] run past the end of the "
                                 "data section (16 bytes; file truncated?)");
}

TEST_F(SafetensorsTest, ShapeSizeMismatch) {
  const std::string path = WriteRaw(
      "mismatch.safetensors", R"({"m.w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8);
  EXPECT_EQ(OpenError(path), "safetensors file " + path +
                                 ": tensor m.w: shape [3] of F32 is 12 bytes but data_offsets "
                                 "[0, 8] span 8");
}

TEST_F(SafetensorsTest, BadJson) {
  const std::string path = WriteRaw("json.safetensors", R"({"w":{"dtype":"F32",)", 0);
  EXPECT_THAT(OpenError(path),
              HasSubstr("safetensors file " + path + ": header is not a valid JSON object: "));
  const std::string array = WriteRaw("array.safetensors", "[1,2]", 0);
  EXPECT_THAT(OpenError(array),
              HasSubstr("safetensors file " + array + ": header is not a valid JSON object: "));
}

TEST_F(SafetensorsTest, UnknownDtype) {
  const std::string path = WriteRaw(
      "dtype.safetensors", R"({"q.w":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,1]}})", 1);
  EXPECT_EQ(OpenError(path), "safetensors file " + path + ": tensor q.w: unknown dtype \"Q4_K\"");
}

TEST_F(SafetensorsTest, MalformedEntries) {
  auto err = [&](const std::string& header) {
    return OpenError(WriteRaw("m.safetensors", header, 64));
  };
  const std::string p = "safetensors file " + Path("m.safetensors") + ": ";
  EXPECT_EQ(err(R"({"t":[1]})"), p + "tensor t: header entry is not an object");
  EXPECT_EQ(err(R"({"t":{"shape":[1],"data_offsets":[0,4]}})"),
            p + "tensor t: missing or non-string \"dtype\"");
  EXPECT_EQ(err(R"({"t":{"dtype":"F32","data_offsets":[0,4]}})"),
            p + "tensor t: missing or non-array \"shape\"");
  EXPECT_EQ(err(R"({"t":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,4]}})"),
            p + "tensor t: shape has a negative dimension -1");
  EXPECT_EQ(err(R"({"t":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})"),
            p + "tensor t: shape entries must be integers");
  EXPECT_EQ(err(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0]}})"),
            p + "tensor t: \"data_offsets\" must be two non-negative integers");
  EXPECT_EQ(err(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})"),
            p + "tensor t: data_offsets [8, 4] end before they begin");
  EXPECT_EQ(err(R"({"__metadata__":{"format":1}})"),
            p + "__metadata__ entry format is not a string");
  EXPECT_EQ(err(R"({"__metadata__":[]})"), p + "__metadata__ is not an object");
}

TEST_F(SafetensorsTest, OverlappingRegions) {
  const std::string path = WriteRaw("overlap.safetensors",
                                    R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[20,28]},
                                        "a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]},
                                        "c":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                                    32);
  EXPECT_EQ(OpenError(path),
            "safetensors file " + path + ": tensor b [20, 28) overlaps tensor a [0, 32)");
}

// The tensors must tile the data section: a file that parses but whose bytes
// are not exactly its tensors' is refused, naming the file and the tensor.
TEST_F(SafetensorsTest, HeaderLengthShortenedIntoItsPadding) {
  // The header's trailing spaces still parse when the length field is cut
  // into them; every tensor would then read 3 bytes early.
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
  const std::string padded = header + "   ";
  const std::string ok = WriteRaw("ok.safetensors", padded, 12);
  EXPECT_TRUE(SafetensorsFile::Open(ok).ok());
  const std::string path = WriteRaw("short_len.safetensors", padded, 12,
                                    /*declared_len=*/static_cast<int64_t>(header.size()));
  EXPECT_EQ(OpenError(path), "safetensors file " + path +
                                 ": the data section is 15 bytes but its tensors cover 12 (the "
                                 "last, tensor b, ends at 12); 3 trailing bytes belong to no "
                                 "tensor (a header length that is too short, or bytes appended "
                                 "to the file)");
}

TEST_F(SafetensorsTest, TrailingBytesAfterTheLastTensor) {
  const std::vector<float> w(3, 1.0f);
  const std::string path = Path("trailing.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {Entry("w", "F32", {3}, w)}, {}).ok());
  ASSERT_TRUE(SafetensorsFile::Open(path).ok());
  std::ofstream(path, std::ios::binary | std::ios::app) << "xy";
  EXPECT_EQ(OpenError(path), "safetensors file " + path +
                                 ": the data section is 14 bytes but its tensors cover 12 (the "
                                 "last, tensor w, ends at 12); 2 trailing bytes belong to no "
                                 "tensor (a header length that is too short, or bytes appended "
                                 "to the file)");
  // Data with no tensor at all is as wrong.
  const std::string none = WriteRaw("none.safetensors", "{}", 4);
  EXPECT_EQ(OpenError(none), "safetensors file " + none +
                                 ": the data section is 4 bytes but its tensors cover 0; 4 "
                                 "trailing bytes belong to no tensor (a header length that is "
                                 "too short, or bytes appended to the file)");
}

TEST_F(SafetensorsTest, GapsBetweenTensors) {
  const std::string gap = WriteRaw("gap.safetensors",
                                   R"({"late":{"dtype":"F32","shape":[1],"data_offsets":[12,16]},
                                       "early":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                                   16);
  EXPECT_EQ(OpenError(gap), "safetensors file " + gap +
                                ": tensor late [12, 16) leaves bytes [8, 12) of the data section "
                                "unused after tensor early [0, 8); tensors must be packed back "
                                "to back");
  const std::string lead =
      WriteRaw("lead.safetensors", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8);
  EXPECT_EQ(OpenError(lead), "safetensors file " + lead +
                                 ": tensor w [4, 8) leaves bytes [0, 4) of the data section "
                                 "unused; tensors must be packed back to back");
}

TEST_F(SafetensorsTest, PartlyOverlappingTensors) {
  const std::string path = WriteRaw("partial.safetensors",
                                    R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},
                                        "b":{"dtype":"F32","shape":[3],"data_offsets":[8,20]}})",
                                    20);
  EXPECT_EQ(OpenError(path),
            "safetensors file " + path + ": tensor b [8, 20) overlaps tensor a [0, 12)");
  // Empty tensors own no bytes, wherever their offsets point inside the data.
  const std::string empty = WriteRaw("empty.safetensors",
                                     R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                                         "e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                                     8);
  EXPECT_TRUE(SafetensorsFile::Open(empty).ok());
}

// Anything but a regular file is refused before it is opened: opening a FIFO
// would block start-up until a writer appeared.
TEST_F(SafetensorsTest, FifoIsRefusedWithoutBlocking) {
  const std::string path = Path("model.safetensors");
  ASSERT_EQ(mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  std::promise<absl::Status> opened;
  std::future<absl::Status> result = opened.get_future();
  std::thread t([&] { opened.set_value(SafetensorsFile::Open(path).status()); });
  if (result.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    // Unblock the reader so the test fails instead of hanging.
    const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) ::close(fd);
    t.join();
    FAIL() << "SafetensorsFile::Open blocked on a FIFO for 10 s";
  }
  t.join();
  const absl::Status s = result.get();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "safetensors file " + path +
                             ": not a regular file (a FIFO); reading it could block start-up or "
                             "never end");
}

TEST_F(SafetensorsTest, DevicesAndDirectoriesAreRefused) {
  EXPECT_EQ(OpenError("/dev/zero"),
            "safetensors file /dev/zero: not a regular file (a character device); reading it "
            "could block start-up or never end");
  EXPECT_EQ(OpenError(dir_.string()), "safetensors file " + dir_.string() +
                                          ": not a regular file (a directory); reading it could "
                                          "block start-up or never end");
  // A symlink to a regular file is fine.
  const std::vector<float> w = {1.0f};
  ASSERT_TRUE(WriteSafetensors(Path("real.safetensors"), {Entry("w", "F32", {1}, w)}, {}).ok());
  fs::create_symlink(Path("real.safetensors"), Path("link.safetensors"));
  EXPECT_TRUE(SafetensorsFile::Open(Path("link.safetensors")).ok());
}

}  // namespace
}  // namespace draftfeed
