#include "common/pem_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/file_kind.h"

namespace draftfeed {
namespace {

// Certificates and keys are a few KiB; a larger file is not one.
constexpr size_t kMaxPemBytes = 1 << 20;

// The file's bytes, at most kMaxPemBytes of them. The kind and size are
// checked on the opened descriptor before anything is read: a FIFO would
// block the open and the read forever, and /dev/zero (or a huge file) would
// be read whole into memory. O_NONBLOCK keeps the open of a FIFO from waiting
// for a writer; it changes nothing for a regular file.
absl::StatusOr<std::string> ReadBounded(absl::string_view option, const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return absl::InvalidArgumentError(absl::StrCat(option, " ", path, ": cannot open"));
  struct stat st {};
  std::string why;
  if (fstat(fd, &st) != 0) {
    why = absl::StrCat("cannot stat: ", std::strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    why = absl::StrCat("is ", FileKind(st.st_mode), ", not a regular file holding PEM");
  } else if (st.st_size > static_cast<off_t>(kMaxPemBytes)) {
    why = absl::StrCat(st.st_size, " bytes is over the ", kMaxPemBytes,
                       "-byte limit of a PEM file");
  }
  std::string pem;
  if (why.empty()) {
    // One byte more than the limit tells a file that grew since fstat.
    pem.resize(kMaxPemBytes + 1);
    size_t got = 0;
    while (got < pem.size()) {
      const ssize_t n = read(fd, pem.data() + got, pem.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        why = absl::StrCat("cannot read: ", std::strerror(errno));
        break;
      }
      if (n == 0) break;
      got += static_cast<size_t>(n);
    }
    pem.resize(got);
    if (why.empty() && got > kMaxPemBytes) {
      why = absl::StrCat("is over the ", kMaxPemBytes, "-byte limit of a PEM file");
    }
  }
  close(fd);
  if (!why.empty()) return absl::InvalidArgumentError(absl::StrCat(option, " ", path, ": ", why));
  return pem;
}

}  // namespace

absl::StatusOr<std::string> ReadPemFile(absl::string_view option, const std::string& path,
                                        absl::string_view label) {
  absl::StatusOr<std::string> read = ReadBounded(option, path);
  if (!read.ok()) return read.status();
  std::string pem = *std::move(read);
  constexpr absl::string_view kBegin = "-----BEGIN ";
  const absl::string_view view(pem);
  for (size_t at = view.find(kBegin); at != absl::string_view::npos;
       at = view.find(kBegin, at + 1)) {
    const size_t start = at + kBegin.size();
    const size_t end = view.find("-----", start);
    if (end == absl::string_view::npos) break;
    if (absl::EndsWith(view.substr(start, end - start), label)) return pem;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(option, " ", path, ": no PEM '-----BEGIN ...", label, "-----' block in it"));
}

}  // namespace draftfeed
