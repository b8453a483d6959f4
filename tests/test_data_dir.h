// Where the checked-in test data lives (tests/data): $DRAFTFEED_SOURCE_DIR
// (ctest sets it for every test) or, when a test binary runs by hand, the
// source tree this header was compiled from. One definition for every test
// that reads goldens or checkpoints.
#pragma once

#include <cstdlib>
#include <filesystem>

namespace draftfeed::testing {

inline std::filesystem::path TestDataDir() {
  if (const char* env = std::getenv("DRAFTFEED_SOURCE_DIR"); env != nullptr && *env != '\0') {
    return std::filesystem::path(env) / "tests" / "data";
  }
  return (std::filesystem::path(__FILE__).parent_path() / "data").lexically_normal();
}

}  // namespace draftfeed::testing
