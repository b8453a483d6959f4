// The command-line help and flag-name check that draftfeed's programs share
// (draftfeed-target, draftfeed-bench), in place of absl's: absl's --help
// exits 1, names the build machine's source files, lists flags by file and
// says nothing helpful about a mistyped flag.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace draftfeed {

// Which flags are a program's own, by the file absl reports for each (after
// FlagsUsageConfig::normalize_filename).
using FlagFileFilter = std::function<bool(absl::string_view file)>;

// A heading of --help and the flags under it (names without "--").
struct FlagGroup {
  std::string title;
  std::vector<std::string> flags;
};

// `text` wrapped at 100 columns, each line indented by `indent` spaces.
std::string WrapText(absl::string_view text, size_t indent);

// Every flag of the program, as "  --name (default D)" and its help wrapped
// below it: under each group's title in the order given, then any flag of
// the program that no group names under "Other flags" ("Flags" when there
// are no groups). A group's name that is no flag of the program is listed
// under "Not flags of this program" so that a stale table shows.
std::string FlagsHelp(const std::vector<FlagGroup>& groups, const FlagFileFilter& mine);

// --help (-h, -help, --helpshort, --helpfull) or --version among the
// arguments before a "--": prints help() or "PROGRAM VERSION" to stdout and
// returns 0, the exit code; nullopt when neither is asked for.
std::optional<int> HandleHelpOrVersion(int argc, char** argv, absl::string_view program,
                                       absl::string_view version,
                                       const std::function<std::string()>& help);

// Every --flag before a "--" must name a flag the program has (absl's, and
// --noNAME for a bool; --undefok=NAME,... excuses names as absl does). The
// first unknown one is an error naming it and, where one is close, the
// nearest of the program's flags: "unknown flag --max_batch_token; did you
// mean --max_batch_tokens?". `program` names where --help lists the flags.
absl::Status CheckFlagNames(int argc, char** argv, absl::string_view program,
                            const FlagFileFilter& mine);

}  // namespace draftfeed
