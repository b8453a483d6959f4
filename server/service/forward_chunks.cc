#include "server/service/forward_chunks.h"

#include <algorithm>

namespace draftfeed {

std::vector<ForwardChunk> PlanForwardChunks(std::span<const int32_t> seq_lens,
                                            int64_t max_forward_tokens) {
  const int64_t budget = std::max<int64_t>(1, max_forward_tokens);
  const int64_t align = budget >= kSplitAlign ? kSplitAlign : 1;
  std::vector<ForwardChunk> chunks;
  ForwardChunk chunk;
  int64_t token = 0;  // batch tokens planned so far
  auto close = [&] {
    chunk.token_end = token;
    chunks.push_back(std::move(chunk));
    chunk = ForwardChunk{.token_begin = token};
  };
  for (const int32_t len : seq_lens) {
    int64_t done = 0;  // of this sequence, in earlier chunks
    while (done < len) {
      const int64_t room = budget - (token - chunk.token_begin);
      const int64_t rest = len - done;
      if (rest <= room) {  // the sequence ends in this chunk
        chunk.seq_lens.push_back(static_cast<int32_t>(rest));
        token += rest;
        done = len;
        break;
      }
      // Cut at the last aligned point the room reaches (from the sequence's
      // start); none: close the chunk and cut in the next.
      const int64_t part = (done + room) / align * align - done;
      if (part <= 0) {
        close();
        chunk.resume_tokens = done;
        continue;
      }
      chunk.seq_lens.push_back(static_cast<int32_t>(part));
      chunk.carry_last = true;
      token += part;
      done += part;
      close();
      chunk.resume_tokens = done;
    }
    if ((token - chunk.token_begin) == budget) close();
  }
  if (token > chunk.token_begin) close();
  return chunks;
}

}  // namespace draftfeed
