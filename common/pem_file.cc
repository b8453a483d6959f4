#include "common/pem_file.h"

#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace draftfeed {
namespace {

// Certificates and keys are a few KiB; a larger file is not one.
constexpr size_t kMaxPemBytes = 1 << 20;

}  // namespace

absl::StatusOr<std::string> ReadPemFile(absl::string_view option, const std::string& path,
                                        absl::string_view label) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(option, " ", path, ": cannot open"));
  std::ostringstream text;
  text << in.rdbuf();
  std::string pem = text.str();
  if (pem.size() > kMaxPemBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(option, " ", path, ": ", pem.size(), " bytes is too large for a PEM file"));
  }
  constexpr absl::string_view kBegin = "-----BEGIN ";
  const absl::string_view view(pem);
  for (size_t at = view.find(kBegin); at != absl::string_view::npos;
       at = view.find(kBegin, at + 1)) {
    const size_t start = at + kBegin.size();
    const size_t end = view.find("-----", start);
    if (end == absl::string_view::npos) break;
    if (absl::EndsWith(view.substr(start, end - start), label)) return pem;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(option, " ", path, ": no PEM '-----BEGIN ...", label, "-----' block in it"));
}

}  // namespace draftfeed
