// What a path that is not a regular file is ("a FIFO", "a directory"), for
// errors that refuse to read it: a FIFO blocks a read forever and a device
// such as /dev/zero never ends.
#pragma once

#include <sys/stat.h>

namespace draftfeed {

inline const char* FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace draftfeed
