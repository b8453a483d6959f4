#pragma once
#include <string_view>
namespace draftfeed {
inline constexpr std::string_view kDraftfeedVersion = "0.1.0";
}  // namespace draftfeed
