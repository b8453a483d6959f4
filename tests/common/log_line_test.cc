#include "common/log_line.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>

namespace draftfeed {
namespace {

std::chrono::system_clock::time_point AtMillis(int64_t ms) {
  return std::chrono::system_clock::time_point(std::chrono::milliseconds(ms));
}

TEST(LogTimestamp, IsoUtcWithMilliseconds) {
  EXPECT_EQ(LogTimestamp(AtMillis(1796166669123)), "2026-12-01T23:11:09.123Z");
  EXPECT_EQ(LogTimestamp(AtMillis(0)), "1970-01-01T00:00:00.000Z");
  // Sub-millisecond parts are dropped, never rounded into the next second.
  EXPECT_EQ(LogTimestamp(AtMillis(1796166669999) + std::chrono::microseconds(999)),
            "2026-12-01T23:11:09.999Z");
  // Before 1970 the milliseconds still count up from the whole second below.
  EXPECT_EQ(LogTimestamp(AtMillis(-1)), "1969-12-31T23:59:59.999Z");
}

TEST(LogLine, StampsEachLineOnStderr) {
  testing::internal::CaptureStderr();
  const std::string before = LogTimestamp(std::chrono::system_clock::now());
  LogLine("draftfeed-target: one");
  LogF("draftfeed-target: %d batches, %s", 3, "ok");
  const std::string after = LogTimestamp(std::chrono::system_clock::now());
  const std::string got = testing::internal::GetCapturedStderr();
  // "YYYY-MM-DDTHH:MM:SS.mmmZ " then the line, each on its own line.
  const size_t stamp = before.size();
  ASSERT_EQ(stamp, 24u);
  const size_t newline = got.find('\n');
  ASSERT_NE(newline, std::string::npos) << got;
  const std::string first = got.substr(0, newline), second = got.substr(newline + 1);
  EXPECT_EQ(first.substr(stamp), " draftfeed-target: one");
  EXPECT_EQ(second.substr(stamp), " draftfeed-target: 3 batches, ok\n");
  // The stamps are the times of writing: ISO 8601 strings sort as the times do.
  for (const std::string& line : {first, second}) {
    const std::string t = line.substr(0, stamp);
    EXPECT_LE(before, t) << line;
    EXPECT_LE(t, after) << line;
  }
}

}  // namespace
}  // namespace draftfeed
