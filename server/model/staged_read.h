// Parallel staged reads of host ranges: the bytes of many (pointer, length)
// copies are read by several threads, chunk by chunk, into staging buffers
// that a sink consumes (the CUDA engine's upload, which copies each chunk to
// the device while its thread reads the next). The copies are any host
// memory: views into mapped checkpoint files, gathered buffers, or bytes made
// on the fly (dtype conversions). A range that lies in one of the given
// mapped files is read with pread from the file's descriptor: the kernel's
// readahead keeps the disk busy, the mapping is never faulted in page by
// page, and a file truncated after it was mapped is a short read that names
// it instead of a SIGBUS.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/model/mapped_file.h"

namespace draftfeed {

// One destination range and where its bytes come from: `src` (any host
// memory), or, when `fill` is set, fill(offset, n, out), which writes the
// copy's bytes [offset, offset + n) to `out` and may run on any reader thread
// (chunks of one copy can be filled concurrently).
struct StagedCopy {
  const std::byte* src = nullptr;
  size_t bytes = 0;
  void* dst = nullptr;  // for the sink: a device address, a host address, ...
  std::function<void(size_t offset, size_t n, std::byte* out)> fill;
};

// A copy whose bytes are computed once, by the first thread that needs them,
// and freed when its last chunk has been staged: a dtype conversion of a large
// tensor holds one converted copy only while it is being uploaded.
StagedCopy ComputedCopy(size_t bytes, void* dst, std::function<std::vector<std::byte>()> make);

// One chunk of one copy, staged in buffer (worker, slot).
struct StagedChunk {
  size_t copy = 0;    // index into the copies
  size_t offset = 0;  // within the copy
  size_t bytes = 0;
  void* dst = nullptr;  // the copy's dst + offset
  int worker = 0;
  int slot = 0;
  const std::byte* staged = nullptr;
};

// Where staged chunks go. Each reader thread (worker) owns `slots` buffers of
// chunk_bytes and fills them in turn; every call but Prepare is made on the
// worker's own thread.
class StagingSink {
 public:
  virtual ~StagingSink() = default;
  // Once, before any reader starts: allocate workers x slots buffers.
  virtual absl::Status Prepare(int workers, int slots, size_t chunk_bytes) = 0;
  virtual absl::Status StartWorker(int /*worker*/) { return absl::OkStatus(); }
  virtual std::byte* Buffer(int worker, int slot) = 0;
  // Where the chunk's bytes can be read in place (a host destination), or
  // null to stage them in Buffer(worker, slot). Consume follows either way.
  virtual std::byte* Direct(const StagedChunk& /*chunk*/) { return nullptr; }
  // Blocks until the last transfer out of buffer (worker, slot) has ended.
  virtual absl::Status Reuse(int worker, int slot) = 0;
  // Starts the transfer of a filled chunk; may return before it ends.
  virtual absl::Status Consume(const StagedChunk& chunk) = 0;
  // After the worker's last chunk (also after an error): waits for its transfers.
  virtual absl::Status Finish(int worker) = 0;
};

struct StagedReadProgress {
  uint64_t bytes_done = 0, bytes_total = 0;
  double seconds = 0;
};

struct StagedReadOptions {
  int threads = 0;                // reader threads; 0 = DefaultReadThreads()
  size_t chunk_bytes = 16 << 20;  // a multiple of 4096
  int slots_per_thread = 2;       // 2: one buffer is read while the other is transferred
  // Called from the calling thread every progress_every_s while the readers run.
  std::function<void(const StagedReadProgress&)> progress;
  double progress_every_s = 5;
};

struct StagedReadStats {
  uint64_t bytes = 0;       // all copies
  uint64_t file_bytes = 0;  // of them, read with pread from a mapped file
  size_t chunks = 0;
  int threads = 0;
  double seconds = 0;
};

// min(8, hardware threads): enough requests in flight for an NVMe drive or a
// network disk, and as many threads as can memcpy a page-cache read at once.
int DefaultReadThreads();

// Reads every copy into the sink. Chunks are claimed in order (copy by copy,
// offset by offset), so with one thread the sink sees them in that order;
// every byte is staged exactly once. The first error (a short read, a sink
// failure) stops every reader and is returned; errors name the file.
absl::StatusOr<StagedReadStats> StageParallel(
    std::span<const StagedCopy> copies, std::span<const std::shared_ptr<const MappedFile>> files,
    const StagedReadOptions& options, StagingSink& sink);

// Reads every copy straight into its dst, host memory: the readers of
// StageParallel without staging (the loader's stacked experts).
absl::StatusOr<StagedReadStats> ReadToHost(std::span<const StagedCopy> copies,
                                           std::span<const std::shared_ptr<const MappedFile>> files,
                                           const StagedReadOptions& options);

// Reads whole files with the same readers into buffers it throws away: how
// fast the disk (or the page cache) delivers these files to this process.
absl::StatusOr<StagedReadStats> ReadFilesRaw(const std::vector<std::string>& paths,
                                             const StagedReadOptions& options);

}  // namespace draftfeed
