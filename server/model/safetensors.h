// Safetensors files: a read-only mmap'd reader that validates the whole header
// up front, and a writer. Format: 8-byte little-endian header length N, N bytes
// of JSON header, then the data section that the header's offsets index.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/model/mapped_file.h"
#include "server/model/tensor.h"

namespace draftfeed {

// Bytes per element of a safetensors dtype ("BF16", "I32", ...), 0 if unknown.
size_t SafetensorsDTypeSize(std::string_view dtype);
// The float dtypes the model uses (BF16, F16, F32, F8_E4M3); kInvalid for any other name.
DType DTypeFromSafetensors(std::string_view dtype);

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // as spelled in the file: "BF16", "F32", "I32", "U8", ...
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;  // into the mapping; may be unaligned
  size_t nbytes = 0;
};

// OK when `path` names a regular file (symlinks followed). Anything else (a
// FIFO, a device, a directory) fails naming `what` and the path, before any
// open: opening a FIFO blocks until a writer appears, and a device may never
// end.
absl::Status CheckRegularFile(const std::string& path, std::string_view what);

class SafetensorsFile {
 public:
  // Maps `path` and validates its header; errors name the file and tensor.
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  const std::string& path() const { return path_; }
  // Every tensor, ordered by name.
  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* Find(std::string_view name) const;
  // The header's "__metadata__" (string to string), empty if absent.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Owns the mapping: hold it as long as any `data` pointer is in use.
  std::shared_ptr<const void> storage() const { return mapping_; }
  // The same mapping, with the descriptor that reads it.
  const std::shared_ptr<const MappedFile>& file() const { return mapping_; }

 private:
  std::string path_;
  std::shared_ptr<const MappedFile> mapping_;
  std::map<std::string, SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` in the given order, data packed back to back as the format
// requires (no gaps), after a header padded with spaces so the data section
// starts 8-aligned. `nbytes` must equal dtype size x shape.
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsTensor>& tensors,
                              const std::map<std::string, std::string>& metadata);

}  // namespace draftfeed
