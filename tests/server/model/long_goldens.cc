#include "tests/server/model/long_goldens.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <random>
#include <span>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "server/model/cpu_engine.h"
#include "server/model/safetensors.h"
#include "server/model/tensor.h"

namespace draftfeed::testing {
namespace {

// The CPU engine carries the long sequence (3,000 tokens) with room to spare.
constexpr int64_t kCarryTokens = 4096;

absl::StatusOr<int64_t> MetaInt(const SafetensorsFile& f, const std::string& key) {
  const auto it = f.metadata().find(key);
  int64_t v = 0;
  if (it == f.metadata().end() || !absl::SimpleAtoi(it->second, &v)) {
    return absl::InvalidArgumentError(absl::StrCat(f.path(), ": no integer metadata ", key));
  }
  return v;
}

}  // namespace

absl::StatusOr<LongGoldens> LoadLongGoldens(const std::string& model) {
  const std::filesystem::path path = DataDir() / absl::StrCat("goldens_long_", model, ".safetensors");
  if (!std::filesystem::exists(path)) {
    return absl::NotFoundError(absl::StrCat(path.string(), " is not there"));
  }
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path.string());
  if (!f.ok()) return f.status();
  LongGoldens g;
  absl::StatusOr<int64_t> n = MetaInt(*f, "num_layers"), h = MetaInt(*f, "hidden_size"),
                          t = MetaInt(*f, "seq_len"), r = MetaInt(*f, "num_rows");
  for (const auto* v : {&n, &h, &t, &r}) {
    if (!v->ok()) return v->status();
  }
  if (!f->metadata().contains("layer_types")) {
    return absl::InvalidArgumentError(absl::StrCat(f->path(), ": no layer_types"));
  }
  g.num_layers = *n;
  g.hidden = *h;
  g.layer_types = absl::StrSplit(f->metadata().at("layer_types"), ',');
  const SafetensorsTensor* layers = f->Find("layers");
  if (layers == nullptr || layers->shape.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(f->path(), ": no 1-D tensor layers"));
  }
  const int64_t k = layers->shape[0];
  auto ids = ReadTensor<int32_t>(*f, "seq0.input_ids", "I32", {*t});
  auto rows = ReadTensor<int32_t>(*f, "seq0.rows", "I32", {*r});
  auto lids = ReadTensor<int32_t>(*f, "layers", "I32", {k});
  auto fp32 = ReadTensor<float>(*f, "seq0.fp32.hidden", "F32", {*r, k, *h});
  auto bf16 = ReadTensor<uint16_t>(*f, "seq0.bf16.hidden", "BF16", {*r, k, *h});
  for (const absl::Status& st :
       {ids.status(), rows.status(), lids.status(), fp32.status(), bf16.status()}) {
    if (!st.ok()) return st;
  }
  g.ids = *std::move(ids);
  g.rows = *std::move(rows);
  g.layers = *std::move(lids);
  g.fp32 = *std::move(fp32);
  g.bf16.resize(bf16->size());
  std::transform(bf16->begin(), bf16->end(), g.bf16.begin(), Bf16ToFloat);
  for (size_t i = 0; i < g.rows.size(); ++i) {
    if (g.rows[i] < 0 || g.rows[i] >= *t || (i > 0 && g.rows[i] <= g.rows[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat(f->path(), ": seq0.rows is not ascending within [0, ", *t, ")"));
    }
  }
  absl::StatusOr<MoeGoldens> moe = LoadMoeGoldens(*f, g.num_layers, {*r});
  if (!moe.ok()) return moe.status();
  g.moe = *std::move(moe);
  return g;
}

LongBatch MakeLongBatch(const std::vector<int32_t>& long_ids, int64_t vocab) {
  LongBatch b;
  std::mt19937 rng(20261231);
  auto some = [&](int32_t n) {
    for (int32_t i = 0; i < n; ++i) {
      b.tokens.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab)));
    }
  };
  some(kLeadTokens);
  b.offset = kLeadTokens;
  b.tokens.insert(b.tokens.end(), long_ids.begin(), long_ids.end());
  some(kTailTokens);
  b.lens = {kLeadTokens, static_cast<int32_t>(long_ids.size()), kTailTokens};
  return b;
}

std::vector<ForwardChunk> CutLongSequence(const LongBatch& batch, const std::vector<int32_t>& cuts) {
  const int32_t len = batch.lens[1];
  std::vector<int32_t> ends = cuts;
  ends.push_back(len);
  std::vector<ForwardChunk> chunks;
  int64_t token = 0;
  int32_t done = 0;
  for (size_t i = 0; i < ends.size(); ++i) {
    ForwardChunk c;
    c.token_begin = token;
    if (i == 0) c.seq_lens.push_back(batch.lens[0]);
    c.seq_lens.push_back(ends[i] - done);
    if (i + 1 == ends.size()) c.seq_lens.push_back(batch.lens[2]);
    c.resume_tokens = i == 0 ? 0 : done;
    c.carry_last = i + 1 < ends.size();
    for (int32_t l : c.seq_lens) token += l;
    c.token_end = token;
    done = ends[i];
    chunks.push_back(std::move(c));
  }
  return chunks;
}

std::vector<int32_t> CutsOfLongSequence(const LongBatch& batch,
                                        const std::vector<ForwardChunk>& chunks) {
  std::vector<int32_t> cuts;
  const int64_t end = batch.offset + batch.lens[1];
  for (const ForwardChunk& c : chunks) {
    if (c.carry_last && c.token_end > batch.offset && c.token_end < end) {
      cuts.push_back(static_cast<int32_t>(c.token_end - batch.offset));
    }
  }
  return cuts;
}

std::vector<ForwardChunk> OneForward(const LongBatch& batch) {
  ForwardChunk c;
  c.token_end = static_cast<int64_t>(batch.tokens.size());
  c.seq_lens = batch.lens;
  return {c};
}

namespace {

// Runs each chunk on `forward(in, first, count)`: its ForwardInput and the
// capture elements [first, first + count) it writes, `row` elements a token.
template <typename Forward>
absl::Status ForEachChunk(const LongBatch& batch, const std::vector<ForwardChunk>& chunks,
                          const std::vector<int32_t>& layers, size_t row, Forward forward) {
  for (const ForwardChunk& c : chunks) {
    ForwardInput in{std::span<const int32_t>(batch.tokens)
                        .subspan(static_cast<size_t>(c.token_begin), static_cast<size_t>(c.tokens())),
                    c.seq_lens, layers};
    in.resume_tokens = c.resume_tokens;
    in.carry_last = c.carry_last;
    DF_RETURN_IF_ERROR(forward(in, static_cast<size_t>(c.token_begin) * row,
                               static_cast<size_t>(c.tokens()) * row));
  }
  return absl::OkStatus();
}

size_t RowElements(const Engine& engine, const std::vector<int32_t>& layers) {
  return layers.size() * static_cast<size_t>(engine.model().config.hidden_size);
}

}  // namespace

absl::StatusOr<std::vector<float>> RunChunksFloat(CpuEngine& engine, const LongBatch& batch,
                                                  const std::vector<ForwardChunk>& chunks,
                                                  const std::vector<int32_t>& layers) {
  const size_t row = RowElements(engine, layers);
  std::vector<float> out(batch.tokens.size() * row);
  DF_RETURN_IF_ERROR(ForEachChunk(
      batch, chunks, layers, row, [&](const ForwardInput& in, size_t first, size_t count) {
        return engine.ForwardFloat(in, std::span<float>(out).subspan(first, count));
      }));
  return out;
}

absl::StatusOr<std::vector<float>> RunChunksBf16(Engine& engine, const LongBatch& batch,
                                                 const std::vector<ForwardChunk>& chunks,
                                                 const std::vector<int32_t>& layers) {
  const size_t row = RowElements(engine, layers);
  std::vector<uint16_t> bits(batch.tokens.size() * row);
  DF_RETURN_IF_ERROR(ForEachChunk(
      batch, chunks, layers, row, [&](const ForwardInput& in, size_t first, size_t count) {
        return engine.Forward(in, std::as_writable_bytes(std::span(bits).subspan(first, count)));
      }));
  std::vector<float> out(bits.size());
  std::transform(bits.begin(), bits.end(), out.begin(), Bf16ToFloat);
  return out;
}

void LongGoldensTest::SetUp() {
  absl::StatusOr<LongGoldens> g = LoadLongGoldens(GetParam());
  if (absl::IsNotFound(g.status())) {
    GTEST_SKIP() << g.status().message()
                 << ": the long goldens are made where transformers (>= 5) runs, from the repo "
                    "root: `python3 tests/data/make_long_goldens.py --out tests/data` "
                    "(tests/data/README.md, \"Long-sequence goldens\")";
  }
  ASSERT_TRUE(g.ok()) << g.status();
  goldens_ = *std::move(g);
  absl::StatusOr<Loaded> l = LoadWithEngine((DataDir() / "models" / GetParam()).string());
  ASSERT_TRUE(l.ok()) << GetParam() << ": " << l.status();
  loaded_ = *std::move(l);
  const ModelConfig& c = loaded_.model->config;
  ASSERT_EQ(c.num_layers, goldens_.num_layers);
  ASSERT_EQ(c.hidden_size, goldens_.hidden);
  ASSERT_EQ(goldens_.layer_types.size(), c.layer_types.size());
  for (size_t i = 0; i < c.layer_types.size(); ++i) {
    ASSERT_EQ(goldens_.layer_types[i], KindName(c.layer_types[i])) << "layer " << i;
  }
  const absl::Status carry = loaded_.engine->ReserveCarry(kCarryTokens);
  ASSERT_TRUE(carry.ok()) << carry;
  h_ = goldens_.hidden;
  k_ = static_cast<int64_t>(goldens_.layers.size());
  batch_ = MakeLongBatch(goldens_.ids, c.vocab_size);
}

std::vector<float> LongGoldensTest::OursAtRows(const std::vector<float>& capture,
                                               int64_t k) const {
  std::vector<float> out;
  out.reserve(goldens_.rows.size() * static_cast<size_t>(h_));
  for (const int32_t r : goldens_.rows) {
    const auto at = capture.begin() + ((batch_.offset + r) * k_ + k) * h_;
    out.insert(out.end(), at, at + h_);
  }
  return out;
}

std::vector<float> LongGoldensTest::Golden(int64_t k, bool bf16) const {
  return Layer(bf16 ? goldens_.bf16 : goldens_.fp32, static_cast<int64_t>(goldens_.rows.size()),
               k_, k, h_);
}

std::string LongGoldensTest::SlotName(int64_t k) const {
  const int32_t id = goldens_.layers[static_cast<size_t>(k)];
  return id == kFinalLayerId
             ? "final"
             : absl::StrCat("layer", id, " (",
                            KindName(loaded_.model->config.layer_types[static_cast<size_t>(id)]),
                            ")");
}

std::vector<std::string> LongGoldensTest::SlotNames() const {
  std::vector<std::string> names;
  for (int64_t k = 0; k < k_; ++k) names.push_back(SlotName(k));
  return names;
}

std::vector<Err> LongGoldensTest::ExpectMatchesFp32(const std::vector<float>& capture,
                                                    const std::string& what) {
  std::vector<Err> errs;
  for (int64_t k = 0; k < k_; ++k) {
    const Err e = Compare(OursAtRows(capture, k), Golden(k), h_);
    EXPECT_TRUE(e.Within(kRelTol, kAbsTol))
        << GetParam() << " " << what << " " << SlotName(k) << ": " << Describe(e);
    errs.push_back(e);
  }
  return errs;
}

void LongGoldensTest::ExpectRowsAround(const std::vector<int32_t>& cuts) const {
  for (const int32_t c : cuts) {
    for (const int32_t r : {c - 1, c}) {
      ASSERT_TRUE(std::binary_search(goldens_.rows.begin(), goldens_.rows.end(), r))
          << GetParam() << ": the goldens store no row " << r << " next to the cut at " << c
          << " (make_long_goldens.py's rows rule)";
    }
  }
}

const std::vector<float>& LongGoldensTest::OnePass() {
  static std::map<std::string, std::vector<float>> cache;
  auto it = cache.find(GetParam());
  if (it == cache.end()) {
    absl::StatusOr<std::vector<float>> out =
        RunChunksFloat(*loaded_.engine, batch_, OneForward(batch_), goldens_.layers);
    EXPECT_TRUE(out.ok()) << out.status();
    it = cache.emplace(GetParam(), out.ok() ? *std::move(out) : std::vector<float>()).first;
  }
  return it->second;
}

std::string ErrTable(const std::string& model, const std::string& what,
                     const std::vector<std::string>& slots, const std::vector<Err>& errs) {
  std::ostringstream t;
  t << model << " " << what << "\n"
    << absl::StrFormat("  %-26s %10s %10s %10s %10s %12s\n", "layer", "max|ref|", "max_abs",
                       "max_rel", "rms_rel", "min_cos");
  for (size_t k = 0; k < errs.size(); ++k) {
    const Err& e = errs[k];
    t << absl::StrFormat("  %-26s %10.3e %10.3e %10.3e %10.3e %12.9f\n", slots[k], e.max_ref,
                         e.max_abs, e.max_rel, e.rms_rel, e.min_cos);
  }
  return t.str();
}

}  // namespace draftfeed::testing
