// The HiddenChunk envelope codec in envelopes/s, against protobuf's generated code for the same;
// and the fp8_e4m3 capture codec in MB/s of fp8 bytes.
//
//   build/bin/draftfeed-bench-codec
//
// A chunk of 81 Qwen3.6-27B tokens (5 captured layers of 5,120 bf16: 4.1 MB,
// under TargetServiceOptions' 4 MiB chunk_bytes). Protobuf is timed twice:
// on the header fields alone (the codec's own work, done by the generated
// code) and on the whole message, payload included, which is what the
// envelope spares the target and the client: a copy of every payload byte.
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bench/micro/benchmark_main.h"
#include "benchmark/benchmark.h"
#include "common/chunk_envelope.h"
#include "common/fp8_capture.h"
#include "draftfeed/v1/draftfeed.pb.h"

namespace draftfeed {
namespace {

constexpr ChunkHeader kHeader = {.batch_id = 123456, .token_offset = 8100, .token_count = 81};
constexpr uint64_t kPayloadBytes = 81 * 5 * 5120 * 2;

v1::StreamResponse Message(bool with_payload) {
  v1::StreamResponse m;
  v1::HiddenChunk* c = m.mutable_chunk();
  c->set_batch_id(kHeader.batch_id);
  c->set_token_offset(kHeader.token_offset);
  c->set_token_count(kHeader.token_count);
  if (with_payload) c->set_data(std::string(kPayloadBytes, '\x5a'));
  return m;
}

void BM_EncodeChunkEnvelope(benchmark::State& state) {
  uint8_t out[kMaxChunkEnvelopeBytes];
  ChunkHeader h = kHeader;
  for (auto _ : state) {
    benchmark::DoNotOptimize(h);
    benchmark::DoNotOptimize(EncodeChunkEnvelope(h, kPayloadBytes, out));
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_EncodeChunkEnvelope);

void BM_ProtobufSerializeHeader(benchmark::State& state) {
  const v1::StreamResponse m = Message(false);
  std::vector<uint8_t> out(m.ByteSizeLong());
  for (auto _ : state) {
    benchmark::DoNotOptimize(m.SerializeToArray(out.data(), static_cast<int>(out.size())));
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_ProtobufSerializeHeader);

void BM_ProtobufSerializeChunk(benchmark::State& state) {
  const v1::StreamResponse m = Message(true);
  std::vector<uint8_t> out(m.ByteSizeLong());
  for (auto _ : state) {
    benchmark::DoNotOptimize(m.SerializeToArray(out.data(), static_cast<int>(out.size())));
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * out.size()));
}
BENCHMARK(BM_ProtobufSerializeChunk);

// `form`: 0 reads the encoder's canonical envelope, 1 what protobuf's own
// serializer writes for the same chunk. Only a prefix is handed over, as
// the client peeks at the first gRPC slice.
void BM_DecodeChunkEnvelope(benchmark::State& state) {
  std::vector<uint8_t> prefix(64);
  uint64_t message_bytes = 0;
  if (state.range(0) == 0) {
    const size_t n = EncodeChunkEnvelope(kHeader, kPayloadBytes, prefix.data());
    message_bytes = n + kPayloadBytes;
  } else {
    const std::string wire = Message(true).SerializeAsString();
    prefix.assign(wire.begin(), wire.begin() + 64);
    message_bytes = wire.size();
  }
  for (auto _ : state) {
    absl::StatusOr<DecodedChunkEnvelope> d = DecodeChunkEnvelope(prefix, message_bytes);
    if (!d.ok() || d->header != kHeader) {
      state.SkipWithError("the envelope did not decode to its header");
      break;
    }
    benchmark::DoNotOptimize(d);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_DecodeChunkEnvelope)->ArgName("protobuf_written")->Arg(0)->Arg(1);

void BM_ProtobufParseHeader(benchmark::State& state) {
  const std::string wire = Message(false).SerializeAsString();
  v1::StreamResponse m;
  for (auto _ : state) {
    benchmark::DoNotOptimize(m.ParseFromString(wire));
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_ProtobufParseHeader);

void BM_ProtobufParseChunk(benchmark::State& state) {
  const std::string wire = Message(true).SerializeAsString();
  v1::StreamResponse m;
  for (auto _ : state) {
    benchmark::DoNotOptimize(m.ParseFromString(wire));
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * wire.size()));
}
BENCHMARK(BM_ProtobufParseChunk);

// The fp8_e4m3 capture codec on the same chunk (81 tokens x 5 layers x
// 5,120): the client's dequantization on the way in (to bf16, and to fp32)
// and the host encoder the CPU engine uses. Bytes are fp8 wire bytes, so
// MB/s compares with a connection's rate directly.
constexpr int64_t kTokens = 81, kLayers = 5, kHidden = 5120;

std::vector<float> Fp8States() {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(kTokens * kLayers * kHidden));
  for (float& v : x) v = d(rng);
  return x;
}

std::vector<std::byte> Fp8Chunk() {
  std::vector<std::byte> out(static_cast<size_t>(kTokens * (kLayers * kHidden + 4 * kLayers)));
  if (!EncodeFp8Capture(Fp8States(), kTokens, kLayers, kHidden, out).ok()) std::abort();
  return out;
}

void BM_DecodeFp8ToBf16(benchmark::State& state) {
  const std::vector<std::byte> in = Fp8Chunk();
  std::vector<uint16_t> out(static_cast<size_t>(kTokens * kLayers * kHidden));
  for (auto _ : state) {
    benchmark::DoNotOptimize(DecodeFp8CaptureToBf16(in, kTokens, kLayers, kHidden, out).ok());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * in.size()));
}
BENCHMARK(BM_DecodeFp8ToBf16);

void BM_DecodeFp8ToFloat(benchmark::State& state) {
  const std::vector<std::byte> in = Fp8Chunk();
  std::vector<float> out(static_cast<size_t>(kTokens * kLayers * kHidden));
  for (auto _ : state) {
    benchmark::DoNotOptimize(DecodeFp8CaptureToFloat(in, kTokens, kLayers, kHidden, out).ok());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * in.size()));
}
BENCHMARK(BM_DecodeFp8ToFloat);

void BM_EncodeFp8FromFloat(benchmark::State& state) {
  const std::vector<float> x = Fp8States();
  std::vector<std::byte> out(static_cast<size_t>(kTokens * (kLayers * kHidden + 4 * kLayers)));
  for (auto _ : state) {
    benchmark::DoNotOptimize(EncodeFp8Capture(x, kTokens, kLayers, kHidden, out).ok());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * out.size()));
}
BENCHMARK(BM_EncodeFp8FromFloat);

}  // namespace
}  // namespace draftfeed

int main(int argc, char** argv) {
  if (!draftfeed::bench::InitBenchmarks(argc, argv, "0.2")) return 1;
  return draftfeed::bench::RunRegisteredBenchmarks();
}
