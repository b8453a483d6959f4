// libFuzzer target: SafetensorsFile::Open on arbitrary file contents. The
// bytes go into an anonymous in-memory file (memfd) so the real reader runs
// unchanged: the regular-file check, mmap, the header length, the JSON header
// and the tiling of the data section. When a file is accepted, its tensors
// must describe the data section exactly (the reader's own promise), checked
// here independently and by touching every byte it hands out.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "server/model/safetensors.h"

namespace {

void Require(bool ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "fuzz_safetensors: invariant broken: %s\n", what);
    abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memfd_create("fuzz.safetensors", MFD_CLOEXEC);
  if (fd < 0) abort();
  size_t written = 0;
  while (written < size) {
    const ssize_t n = write(fd, data + written, size - written);
    if (n <= 0) abort();
    written += static_cast<size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  {
    auto file = draftfeed::SafetensorsFile::Open(path);
    if (!file.ok()) {
      // Every refusal names the file.
      Require(std::string(file.status().message()).find(path) != std::string::npos,
              "an error message that names the file");
    } else {
      uint64_t header_len = 0;
      for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];
      const uint64_t data_size = size - 8 - header_len;
      std::vector<const draftfeed::SafetensorsTensor*> nonempty;
      uint64_t total = 0;
      for (const auto& [name, t] : file->tensors()) {
        Require(name == t.name, "tensors keyed by their name");
        uint64_t numel = 1;
        for (int64_t d : t.shape) {
          Require(d >= 0, "non-negative dimensions");
          Require(!__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel),
                  "a shape whose product fits");
        }
        const size_t elem = draftfeed::SafetensorsDTypeSize(t.dtype);
        Require(elem > 0, "a known dtype");
        Require(numel * elem == t.nbytes, "nbytes = shape x dtype size");
        total += t.nbytes;
        if (t.nbytes > 0) nonempty.push_back(&t);
      }
      Require(total == data_size, "tensors that cover the data section");
      std::sort(nonempty.begin(), nonempty.end(),
                [](auto* a, auto* b) { return a->data < b->data; });
      for (size_t i = 1; i < nonempty.size(); ++i) {
        Require(nonempty[i - 1]->data + nonempty[i - 1]->nbytes == nonempty[i]->data,
                "tensors packed back to back");
      }
      // Reads every byte handed out: a pointer past the mapping faults here.
      volatile uint8_t sink = 0;
      for (const auto* t : nonempty) {
        for (size_t i = 0; i < t->nbytes; ++i) sink = sink ^ static_cast<uint8_t>(t->data[i]);
      }
      (void)sink;
    }
  }
  close(fd);
  return 0;
}
