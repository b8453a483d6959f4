// Milliseconds since a steady_clock point: the unit of every timing the
// service reports (Timings in BatchDone).
#pragma once

#include <chrono>

namespace draftfeed {

inline double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace draftfeed
