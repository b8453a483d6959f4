#include "server/service/flags_help.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace draftfeed {
namespace {

constexpr size_t kWidth = 100;

std::vector<const absl::CommandLineFlag*> ProgramFlags(const FlagFileFilter& mine) {
  std::vector<const absl::CommandLineFlag*> out;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!flag->IsRetired() && mine(flag->Filename())) out.push_back(flag);
  }
  std::sort(out.begin(), out.end(), [](auto* a, auto* b) { return a->Name() < b->Name(); });
  return out;
}

std::string DescribeFlag(const absl::CommandLineFlag& f) {
  std::string def = f.DefaultValue();
  if (f.IsOfType<std::string>()) def = absl::StrCat("\"", def, "\"");
  return absl::StrCat("  --", std::string(f.Name()), " (default ", def, ")\n",
                      WrapText(f.Help(), 6));
}

// Edits (insert, delete, substitute, swap two neighbours) from a to b: a
// swap is one typo, as "--modle" is of "--model".
size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t sub = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + sub});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// The name absl would look up for one argument ("--name=value" -> "name"),
// or empty for a positional argument.
absl::string_view FlagName(absl::string_view arg) {
  if (arg.size() < 2 || arg[0] != '-') return {};
  arg.remove_prefix(arg[1] == '-' ? 2 : 1);
  return arg.substr(0, arg.find('='));
}

}  // namespace

std::string WrapText(absl::string_view text, size_t indent) {
  std::string out, line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!line.empty() && indent + line.size() + 1 + word.size() > kWidth) {
      absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
      line.clear();
    }
    absl::StrAppend(&line, line.empty() ? "" : " ", word);
  }
  if (!line.empty()) absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
  return out;
}

std::string FlagsHelp(const std::vector<FlagGroup>& groups, const FlagFileFilter& mine) {
  const std::vector<const absl::CommandLineFlag*> flags = ProgramFlags(mine);
  std::set<std::string> listed;
  std::vector<std::string> stale;
  std::string out;
  for (const FlagGroup& g : groups) {
    absl::StrAppend(&out, out.empty() ? "" : "\n", g.title, ":\n");
    for (const std::string& name : g.flags) {
      const auto it = std::find_if(flags.begin(), flags.end(),
                                   [&](auto* f) { return f->Name() == name; });
      if (it == flags.end()) {
        stale.push_back(name);
        continue;
      }
      listed.insert(name);
      absl::StrAppend(&out, DescribeFlag(**it));
    }
  }
  std::string rest;
  for (const absl::CommandLineFlag* f : flags) {
    if (listed.count(std::string(f->Name())) == 0) absl::StrAppend(&rest, DescribeFlag(*f));
  }
  if (!rest.empty()) {
    absl::StrAppend(&out, out.empty() ? "" : "\n", groups.empty() ? "Flags" : "Other flags",
                    " (--name=value):\n", rest);
  }
  if (!stale.empty()) {
    absl::StrAppend(&out, "\nNot flags of this program (the help's table is stale): --",
                    absl::StrJoin(stale, ", --"), "\n");
  }
  return out;
}

std::optional<int> HandleHelpOrVersion(int argc, char** argv, absl::string_view program,
                                       absl::string_view version,
                                       const std::function<std::string()>& help) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view a = argv[i];
    if (a == "--") break;
    if (a == "--help" || a == "-help" || a == "-h" || a == "--helpshort" || a == "-helpshort" ||
        a == "--helpfull" || a == "-helpfull") {
      std::fputs(help().c_str(), stdout);
      return 0;
    }
    if (a == "--version" || a == "-version") {
      std::printf("%s %s\n", std::string(program).c_str(), std::string(version).c_str());
      return 0;
    }
  }
  return std::nullopt;
}

absl::Status CheckFlagNames(int argc, char** argv, absl::string_view program,
                            const FlagFileFilter& mine) {
  std::set<std::string> excused;
  for (int i = 1; i < argc && absl::string_view(argv[i]) != "--"; ++i) {
    const absl::string_view a = argv[i];
    if (FlagName(a) == "undefok" && a.find('=') != absl::string_view::npos) {
      for (absl::string_view n : absl::StrSplit(a.substr(a.find('=') + 1), ',')) {
        excused.insert(std::string(n));
      }
    }
  }
  for (int i = 1; i < argc; ++i) {
    const absl::string_view a = argv[i];
    if (a == "--") break;
    const absl::string_view name = FlagName(a);
    if (name.empty()) continue;  // positional
    const absl::CommandLineFlag* f = absl::FindCommandLineFlag(name);
    if (f != nullptr) {
      // "--name value": the next argument is the value, not a flag.
      if (a.find('=') == absl::string_view::npos && !f->IsOfType<bool>()) ++i;
      continue;
    }
    if (name.substr(0, 2) == "no") {
      const absl::CommandLineFlag* b = absl::FindCommandLineFlag(name.substr(2));
      if (b != nullptr && b->IsOfType<bool>()) continue;
    }
    if (excused.count(std::string(name)) > 0 ||
        (name.substr(0, 2) == "no" && excused.count(std::string(name.substr(2))) > 0)) {
      continue;
    }
    // Dashes for underscores is the commonest slip: compare as underscores.
    std::string typed(name);
    std::replace(typed.begin(), typed.end(), '-', '_');
    std::string best;
    size_t best_d = std::string::npos;
    for (const absl::CommandLineFlag* c : ProgramFlags(mine)) {
      std::vector<std::string> spellings = {std::string(c->Name())};
      if (c->IsOfType<bool>()) spellings.push_back(absl::StrCat("no", c->Name()));
      for (const std::string& spelling : spellings) {
        const size_t d = EditDistance(typed, spelling);
        if (d < best_d) {
          best_d = d;
          best = spelling;
        }
      }
    }
    std::string msg = absl::StrCat("unknown flag --", std::string(name));
    if (best_d == 0) {
      absl::StrAppend(&msg, "; did you mean --", best, "? (flag names are written with '_')");
    } else if (best_d <= std::max<size_t>(2, typed.size() / 4)) {
      absl::StrAppend(&msg, "; did you mean --", best, "?");
    } else {
      absl::StrAppend(&msg, "; ", std::string(program), " --help lists the flags");
    }
    return absl::InvalidArgumentError(msg);
  }
  return absl::OkStatus();
}

}  // namespace draftfeed
