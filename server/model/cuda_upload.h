// Host ranges to one GPU at the speed of the slower of the disk and the link:
// StageParallel's readers fill pinned chunks, and each reader enqueues its
// chunk's cudaMemcpyAsync on a stream of its own and goes on to fill its
// other chunk while the copy runs (an event per chunk says when it can be
// refilled). Any host memory works as a source: mapped checkpoint files (read
// with pread when `files` names them), gathered buffers, computed copies.
#pragma once

#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "server/model/mapped_file.h"
#include "server/model/staged_read.h"
#include "server/model/tensor.h"

namespace draftfeed {

// Copies every copy's bytes to its `dst` (a device address on `device`) and
// returns once all are on the device. `what` ("cuda:0") prefixes the
// progress lines, which go to stderr every few seconds for a long upload, and
// the closing line (bytes, seconds, GB/s, threads) for one of 1 GiB or more.
absl::StatusOr<StagedReadStats> UploadToDevice(
    std::span<const StagedCopy> copies, std::span<const std::shared_ptr<const MappedFile>> files,
    int device, StagedReadOptions options, const std::string& what);

// Host tensor `t` to `dst` as bf16: its own bytes when it is bf16, else
// converted (ToFloat, then rounded) when the copy's first chunk is read. `t`
// must outlive the copy.
StagedCopy Bf16Copy(const Tensor& t, void* dst);

}  // namespace draftfeed
