#include "server/model/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace draftfeed {
namespace {

absl::Status Errno(int err, const std::string& what) {
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  return absl::InternalError(msg);
}

// Closes the descriptor on every path out.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

absl::StatusOr<std::shared_ptr<const MappedFile>> MappedFile::Map(int fd, std::string path,
                                                                  size_t size) {
  Fd owned{fd};
  void* addr = size == 0 ? nullptr : mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (addr == MAP_FAILED) return Errno(errno, absl::StrCat("cannot mmap ", path));
  owned.fd = -1;
  return std::shared_ptr<const MappedFile>(
      new MappedFile(fd, std::move(path), static_cast<const std::byte*>(addr), size));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) munmap(const_cast<std::byte*>(data_), size_);
  ::close(fd_);
}

absl::Status EvictFromPageCache(const std::string& path) {
  // Read-only is enough for both calls; fsync first, since DONTNEED keeps dirty pages.
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) return Errno(errno, absl::StrCat("cannot open ", path));
  if (::fsync(f.fd) != 0 && errno != EINVAL) {
    return Errno(errno, absl::StrCat("cannot fsync ", path));
  }
  if (const int err = posix_fadvise(f.fd, 0, 0, POSIX_FADV_DONTNEED); err != 0) {
    return Errno(err, absl::StrCat("posix_fadvise(DONTNEED) on ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<double> ResidentFraction(const std::string& path) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) return Errno(errno, absl::StrCat("cannot open ", path));
  struct stat st;
  if (fstat(f.fd, &st) != 0) return Errno(errno, absl::StrCat("cannot stat ", path));
  const size_t size = static_cast<size_t>(st.st_size);
  if (size == 0) return 1.0;
  // A mapping of its own: mincore reports the page cache, not this mapping's faults.
  void* addr = mmap(nullptr, size, PROT_READ, MAP_SHARED, f.fd, 0);
  if (addr == MAP_FAILED) return Errno(errno, absl::StrCat("cannot mmap ", path));
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((size + page - 1) / page);
  const int rc = mincore(addr, size, resident.data());
  const int err = errno;
  munmap(addr, size);
  if (rc != 0) return Errno(err, absl::StrCat("mincore on ", path));
  size_t in = 0;
  for (unsigned char r : resident) in += r & 1;
  return static_cast<double>(in) / static_cast<double>(resident.size());
}

}  // namespace draftfeed
