// The host side of the BatchDone payload checksum (defined in
// kernels/checksum_terms.h, which the GPU kernel shares): an incremental,
// vectorised hasher that can copy while it hashes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/checksum_terms.h"

namespace draftfeed::v1 {

// Fed in pieces (a batch's chunks, in order). CopyAndUpdate copies a piece to
// its destination in the same pass, so the bytes are read once.
class PayloadHasher {
 public:
  PayloadHasher() { Reset(); }
  void Reset();

  void Update(const void* data, size_t n) { Consume(nullptr, data, n); }
  // Copies n bytes from src to dst (not overlapping) and hashes them.
  void CopyAndUpdate(void* dst, const void* src, size_t n) { Consume(dst, src, n); }

  uint64_t Finish() const;
  size_t bytes_seen() const { return seen_; }

 private:
  void Consume(void* dst, const void* src, size_t n);

  uint64_t lanes_[kChecksumLanes];
  unsigned char pending_[8 * kChecksumLanes];  // a partial stripe
  size_t pending_bytes_ = 0;
  size_t seen_ = 0;
};

uint64_t PayloadChecksum(const void* data, size_t n);

// The plain definition, word by word: the reference the vectorised hasher and
// the GPU kernel are tested against.
uint64_t PayloadChecksumReference(const void* data, size_t n);

// Tests pin the vectorised path so each one is checked on a machine that has
// it: 0 chooses by CPU (the default), 1 is SSE2, 2 is AVX2. False where the
// path cannot run here (not x86-64, or no AVX2).
bool UseChecksumPathForTesting(int path);

}  // namespace draftfeed::v1
