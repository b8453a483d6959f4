// Log lines on stderr, each stamped with the time it was written: a target's
// log (kubectl logs, a Slurm job's file) is read beside other hosts' logs and
// the metrics, and a line without a time cannot be placed among them.
#pragma once

#include <chrono>
#include <string>
#include <string_view>

namespace draftfeed {

// ISO 8601 in UTC with milliseconds: "2026-12-01T23:11:09.123Z".
std::string LogTimestamp(std::chrono::system_clock::time_point t);

// "<LogTimestamp(now)> <line>\n" to stderr in one write, so that lines from
// concurrent threads never interleave.
void LogLine(std::string_view line);

// LogLine of a printf-style format (checked by the compiler).
void LogF(const char* format, ...) __attribute__((format(printf, 1, 2)));

}  // namespace draftfeed
