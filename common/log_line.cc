#include "common/log_line.h"

#include <cstdarg>
#include <cstdio>
#include <ctime>

namespace draftfeed {

std::string LogTimestamp(std::chrono::system_clock::time_point t) {
  // floor, not truncation: the milliseconds stay in [0, 1000) either side of 1970.
  const auto since_epoch = t.time_since_epoch();
  const auto seconds = std::chrono::floor<std::chrono::seconds>(since_epoch);
  const auto millis =
      std::chrono::duration_cast<std::chrono::milliseconds>(since_epoch - seconds).count();
  const std::time_t whole = static_cast<std::time_t>(seconds.count());
  std::tm utc{};
  gmtime_r(&whole, &utc);
  char out[96];  // the compiler counts the widest int fields, not the real date
  std::snprintf(out, sizeof out, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", utc.tm_year + 1900,
                utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec,
                static_cast<int>(millis));
  return out;
}

void LogLine(std::string_view line) {
  std::string out = LogTimestamp(std::chrono::system_clock::now());
  out.reserve(out.size() + line.size() + 2);
  out += ' ';
  out += line;
  out += '\n';
  std::fwrite(out.data(), 1, out.size(), stderr);
}

void LogF(const char* format, ...) {
  std::va_list args;
  va_start(args, format);
  std::va_list again;
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, format, args);
  va_end(args);
  std::string line(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(line.data(), line.size() + 1, format, again);
  va_end(again);
  LogLine(line);
}

}  // namespace draftfeed
