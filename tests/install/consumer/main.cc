// Streams one batch from a target through an installed draftfeed client and
// prints what came back: its sizes, the target's payload checksum (which the
// client verified while receiving) and a digest of the bytes.
//   draftfeed_consumer HOST:PORT
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "draftfeed/client.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s HOST:PORT\n", argv[0]);
    return 2;
  }
  draftfeed::FeedOptions opt;
  opt.targets = {argv[1]};
  opt.layers = {0, -1};
  opt.verify_checksum = true;  // a mismatch would come back from Next() as DATA_LOSS
  auto feed = draftfeed::Feed::Open(opt);
  if (!feed.ok()) {
    std::fprintf(stderr, "open: %s\n", feed.status().ToString().c_str());
    return 1;
  }
  std::vector<int32_t> tokens(64);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7 + 3) % 4096);
  auto id = (*feed)->Submit(tokens, {40, 24});
  if (!id.ok()) {
    std::fprintf(stderr, "submit: %s\n", id.status().ToString().c_str());
    return 1;
  }
  auto batch = (*feed)->Next();
  if (!batch.ok()) {
    std::fprintf(stderr, "next: %s\n", batch.status().ToString().c_str());
    return 1;
  }
  const std::span<const uint16_t> bits = batch->bf16();
  if (batch->batch_id != *id || batch->token_ids != tokens ||
      bits.size() !=
          static_cast<size_t>(batch->num_tokens * batch->num_layers * batch->hidden_size)) {
    std::fprintf(stderr, "batch %llu does not match what was sent\n",
                 static_cast<unsigned long long>(batch->batch_id));
    return 1;
  }
  uint64_t fnv = 1469598103934665603ull;  // FNV-1a over the bf16 values, little endian
  for (uint16_t v : bits) {
    fnv = (fnv ^ (v & 0xff)) * 1099511628211ull;
    fnv = (fnv ^ (v >> 8)) * 1099511628211ull;
  }
  std::printf("T=%lld K=%lld H=%lld checksum=%016llx fnv=%016llx\n",
              static_cast<long long>(batch->num_tokens), static_cast<long long>(batch->num_layers),
              static_cast<long long>(batch->hidden_size),
              static_cast<unsigned long long>(batch->checksum),
              static_cast<unsigned long long>(fnv));
  return (*feed)->Close().ok() ? 0 : 1;
}
