#include "server/model/staged_read.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/thread_name.h"

namespace draftfeed {
namespace {

constexpr size_t kChunkAlignment = 4096;

struct Chunk {
  size_t copy, offset, bytes;
};

// pread until `n` bytes are in, or the file ends (it was truncated after it
// was mapped: the loader checked every tensor against the size it had then).
absl::Status PreadFull(const MappedFile& file, std::byte* out, size_t n, uint64_t at) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(file.fd(), out + got, n - got, static_cast<off_t>(at + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return absl::DataLossError(absl::StrCat("cannot read ", file.path(), " at byte ", at + got,
                                              ": ", std::strerror(errno)));
    }
    if (r == 0) {
      struct stat st;
      const std::string now =
          fstat(file.fd(), &st) == 0 ? absl::StrCat(" it is ", st.st_size, " bytes now,") : "";
      return absl::DataLossError(
          absl::StrCat("short read of ", file.path(), ": bytes [", at, ", ", at + n,
                       ") were expected, but", now, " the read ended at byte ", at + got, " (",
                       file.size(), " bytes when it was opened; truncated since?)"));
    }
    got += static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

// Host buffers that are consumed as soon as they are filled.
class DiscardSink final : public StagingSink {
 public:
  absl::Status Prepare(int workers, int slots, size_t chunk_bytes) override {
    slots_ = slots;
    chunk_bytes_ = chunk_bytes;
    buffers_.resize(static_cast<size_t>(workers * slots));
    return absl::OkStatus();
  }
  std::byte* Buffer(int worker, int slot) override {
    auto& b = buffers_[static_cast<size_t>(worker * slots_ + slot)];
    if (b == nullptr) b = std::make_unique<std::byte[]>(chunk_bytes_);
    return b.get();
  }
  absl::Status Reuse(int, int) override { return absl::OkStatus(); }
  absl::Status Consume(const StagedChunk&) override { return absl::OkStatus(); }
  absl::Status Finish(int) override { return absl::OkStatus(); }

 private:
  int slots_ = 1;
  size_t chunk_bytes_ = 0;
  std::vector<std::unique_ptr<std::byte[]>> buffers_;
};

// Reads in place: the destination is the buffer.
class HostSink final : public StagingSink {
 public:
  absl::Status Prepare(int, int, size_t) override { return absl::OkStatus(); }
  std::byte* Buffer(int, int) override { return nullptr; }
  std::byte* Direct(const StagedChunk& c) override { return static_cast<std::byte*>(c.dst); }
  absl::Status Reuse(int, int) override { return absl::OkStatus(); }
  absl::Status Consume(const StagedChunk&) override { return absl::OkStatus(); }
  absl::Status Finish(int) override { return absl::OkStatus(); }
};

}  // namespace

int DefaultReadThreads() {
  const unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp<unsigned>(hw, 1, 8));
}

StagedCopy ComputedCopy(size_t bytes, void* dst, std::function<std::vector<std::byte>()> make) {
  struct State {
    std::function<std::vector<std::byte>()> make;
    std::once_flag once;
    std::vector<std::byte> bytes;
    std::atomic<size_t> remaining;
  };
  auto state = std::make_shared<State>();
  state->make = std::move(make);
  state->remaining = bytes;
  StagedCopy c;
  c.bytes = bytes;
  c.dst = dst;
  c.fill = [state, bytes](size_t offset, size_t n, std::byte* out) {
    std::call_once(state->once, [&] {
      state->bytes = state->make();
      if (state->bytes.size() != bytes) {
        std::fprintf(stderr, "ComputedCopy: made %zu bytes for a copy of %zu\n",
                     state->bytes.size(), bytes);
        std::abort();  // the caller's conversion disagrees with its own size
      }
    });
    std::memcpy(out, state->bytes.data() + offset, n);
    if (state->remaining.fetch_sub(n) == n) std::vector<std::byte>().swap(state->bytes);
  };
  return c;
}

absl::StatusOr<StagedReadStats> StageParallel(
    std::span<const StagedCopy> copies, std::span<const std::shared_ptr<const MappedFile>> files,
    const StagedReadOptions& options, StagingSink& sink) {
  const size_t chunk_bytes = options.chunk_bytes;
  if (chunk_bytes == 0 || chunk_bytes % kChunkAlignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("staged read: chunk_bytes must be a positive multiple of ", kChunkAlignment,
                     ", got ", chunk_bytes));
  }
  if (options.threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("staged read: threads must be >= 0 (0 = default), got ", options.threads));
  }
  if (options.slots_per_thread < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("staged read: slots_per_thread must be >= 1, got ", options.slots_per_thread));
  }

  // Which file each copy lies in (none: a memory copy).
  std::vector<const MappedFile*> file_of(copies.size(), nullptr);
  StagedReadStats stats;
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < copies.size(); ++i) {
    const StagedCopy& c = copies[i];
    if (c.bytes > 0 && c.src == nullptr && !c.fill) {
      return absl::InvalidArgumentError(
          absl::StrCat("staged read: copy ", i, " of ", c.bytes, " bytes has no source"));
    }
    if (!c.fill && c.src != nullptr) {
      for (const auto& f : files) {
        if (f != nullptr && f->Contains(c.src, c.bytes)) {
          file_of[i] = f.get();
          stats.file_bytes += c.bytes;
          break;
        }
      }
    }
    for (size_t off = 0; off < c.bytes; off += chunk_bytes) {
      chunks.push_back({i, off, std::min(chunk_bytes, c.bytes - off)});
    }
    stats.bytes += c.bytes;
  }
  stats.chunks = chunks.size();
  const int wanted = options.threads > 0 ? options.threads : DefaultReadThreads();
  const int workers =
      static_cast<int>(std::min<size_t>(wanted, std::max<size_t>(chunks.size(), 1)));
  stats.threads = workers;
  if (chunks.empty()) return stats;
  const int slots = options.slots_per_thread;
  DF_RETURN_IF_ERROR(sink.Prepare(workers, slots, chunk_bytes));

  std::atomic<size_t> next{0};
  std::atomic<uint64_t> done_bytes{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::condition_variable cv;
  absl::Status first_error;
  int finished = 0;
  auto fail = [&](absl::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    if (first_error.ok()) first_error = std::move(s);
    failed = true;
  };
  auto work = [&](int w) -> absl::Status {
    DF_RETURN_IF_ERROR(sink.StartWorker(w));
    for (int slot = 0; !failed.load(std::memory_order_relaxed); slot = (slot + 1) % slots) {
      const size_t i = next.fetch_add(1);
      if (i >= chunks.size()) break;
      const Chunk& ch = chunks[i];
      const StagedCopy& c = copies[ch.copy];
      StagedChunk staged{
          .copy = ch.copy,
          .offset = ch.offset,
          .bytes = ch.bytes,
          .dst = c.dst == nullptr ? nullptr : static_cast<std::byte*>(c.dst) + ch.offset,
          .worker = w,
          .slot = slot};
      std::byte* buf = sink.Direct(staged);
      if (buf == nullptr) {
        DF_RETURN_IF_ERROR(sink.Reuse(w, slot));
        buf = sink.Buffer(w, slot);
      }
      staged.staged = buf;
      if (c.fill) {
        c.fill(ch.offset, ch.bytes, buf);
      } else if (const MappedFile* f = file_of[ch.copy]; f != nullptr) {
        DF_RETURN_IF_ERROR(
            PreadFull(*f, buf, ch.bytes, static_cast<uint64_t>(c.src - f->data()) + ch.offset));
      } else {
        std::memcpy(buf, c.src + ch.offset, ch.bytes);
      }
      DF_RETURN_IF_ERROR(sink.Consume(staged));
      done_bytes += ch.bytes;
    }
    return absl::OkStatus();
  };

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      NameThisThread("df-read");
      absl::Status s = work(w);
      // Transfers already started must end before their buffers go away.
      absl::Status f = sink.Finish(w);
      if (!s.ok()) fail(std::move(s));
      if (!f.ok()) fail(std::move(f));
      std::lock_guard<std::mutex> lock(mu);
      ++finished;
      cv.notify_all();
    });
  }
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  {
    std::unique_lock<std::mutex> lock(mu);
    const auto every = std::chrono::duration<double>(std::max(options.progress_every_s, 0.01));
    while (!cv.wait_for(lock, every, [&] { return finished == workers; })) {
      if (!options.progress) continue;
      const StagedReadProgress p{done_bytes.load(), stats.bytes, elapsed()};
      lock.unlock();
      options.progress(p);
      lock.lock();
    }
  }
  for (std::thread& t : threads) t.join();
  stats.seconds = elapsed();
  if (!first_error.ok()) return first_error;
  return stats;
}

absl::StatusOr<StagedReadStats> ReadToHost(std::span<const StagedCopy> copies,
                                           std::span<const std::shared_ptr<const MappedFile>> files,
                                           const StagedReadOptions& options) {
  for (size_t i = 0; i < copies.size(); ++i) {
    if (copies[i].bytes > 0 && copies[i].dst == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("read to host: copy ", i, " of ", copies[i].bytes, " bytes has no dst"));
    }
  }
  HostSink sink;
  return StageParallel(copies, files, options, sink);
}

absl::StatusOr<StagedReadStats> ReadFilesRaw(const std::vector<std::string>& paths,
                                             const StagedReadOptions& options) {
  std::vector<std::shared_ptr<const MappedFile>> files;
  std::vector<StagedCopy> copies;
  for (const std::string& path : paths) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
    }
    // Mapped only to name the ranges: every byte is read with pread.
    DF_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> f,
                        MappedFile::Map(fd, path, static_cast<size_t>(st.st_size)));
    copies.push_back({.src = f->data(), .bytes = f->size(), .dst = nullptr, .fill = {}});
    files.push_back(std::move(f));
  }
  DiscardSink sink;
  return StageParallel(copies, files, options, sink);
}

}  // namespace draftfeed
