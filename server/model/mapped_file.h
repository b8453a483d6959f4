// A read-only mapping of a whole file that keeps its descriptor open, so that
// bulk readers can pread the very inode the mapping shows (a checkpoint
// rewritten in place after loading cannot mix old and new bytes), plus the
// page-cache controls the load benchmark needs to start cold.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace draftfeed {

class MappedFile {
 public:
  // Maps `size` bytes of the open regular file `fd` (which it then owns and
  // closes) read-only; `path` names it in messages.
  static absl::StatusOr<std::shared_ptr<const MappedFile>> Map(int fd, std::string path,
                                                               size_t size);
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const std::string& path() const { return path_; }
  int fd() const { return fd_; }
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  bool Contains(const std::byte* p, size_t bytes) const {
    return p >= data_ && p <= data_ + size_ && bytes <= static_cast<size_t>(data_ + size_ - p);
  }

 private:
  MappedFile(int fd, std::string path, const std::byte* data, size_t size)
      : path_(std::move(path)), fd_(fd), data_(data), size_(size) {}

  std::string path_;
  int fd_;
  const std::byte* data_;
  size_t size_;
};

// Drops `path`'s pages from the page cache (fsync, then POSIX_FADV_DONTNEED).
// The kernel may keep some (dirty or mapped pages); ResidentFraction says how
// far it went.
absl::Status EvictFromPageCache(const std::string& path);
// The fraction of `path`'s pages in the page cache now (mincore), in [0, 1].
absl::StatusOr<double> ResidentFraction(const std::string& path);

}  // namespace draftfeed
