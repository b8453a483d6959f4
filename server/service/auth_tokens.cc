#include "server/service/auth_tokens.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace draftfeed {
namespace {

// A token file is a few lines; a larger one is not a token file.
constexpr off_t kMaxTokenFileBytes = 1 << 20;
constexpr size_t kMaxNameBytes = 64;
constexpr absl::string_view kBearer = "Bearer ";

bool ValidName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxNameBytes) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(c) && c != '-' && c != '_' && c != '.') return false;
  }
  return true;
}

// Printable ASCII other than space: what an HTTP/2 header value may carry
// unquoted, and what a copy-paste cannot silently change.
bool ValidTokenChars(absl::string_view token) {
  for (char c : token) {
    if (c <= ' ' || c > '~') return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::vector<NamedToken>> ParseTokenFile(absl::string_view text,
                                                       absl::string_view path) {
  std::vector<NamedToken> tokens;
  std::set<std::string> names;
  int line_no = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_no;
    const absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line.front() == '#') continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", line_no, ": ", why));
    };
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos) {
      return bad("expected 'name: token' (a line of its own for each token, # for comments)");
    }
    NamedToken t;
    t.name = std::string(absl::StripAsciiWhitespace(line.substr(0, colon)));
    const absl::string_view token = absl::StripAsciiWhitespace(line.substr(colon + 1));
    if (!ValidName(t.name)) {
      return bad(absl::StrCat("token name '", absl::CHexEscape(t.name),
                              "' must be 1 to 64 letters, digits, '-', '_' or '.'"));
    }
    if (!ValidTokenChars(token)) {
      return bad(absl::StrCat("the token of '", t.name,
                              "' holds a space or a character that is not printable ASCII"));
    }
    if (token.size() < kMinTokenBytes || token.size() > kMaxTokenBytes) {
      return bad(absl::StrCat("the token of '", t.name, "' has ", token.size(),
                              " characters; tokens have ", kMinTokenBytes, " to ", kMaxTokenBytes,
                              " (e.g. openssl rand -hex 32)"));
    }
    if (!names.insert(t.name).second) {
      return bad(absl::StrCat("token name '", t.name, "' appears twice"));
    }
    for (const NamedToken& other : tokens) {
      if (other.token == token) {
        // Two names for one token would make the logs' name a guess.
        return bad(absl::StrCat("the token of '", t.name, "' is also the token of '", other.name,
                                "'; give each its own"));
      }
    }
    t.token = std::string(token);
    tokens.push_back(std::move(t));
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": no tokens (a target with none would refuse every call)"));
  }
  return tokens;
}

absl::StatusOr<TokenFile> ReadTokenFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_tokens_file=", path, ": cannot open: ", std::strerror(errno)));
  }
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_tokens_file=", path, ": not a regular file"));
  }
  if (st.st_size > kMaxTokenFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--auth_tokens_file=", path, ": ", st.st_size,
                                                   " bytes is not a token file (at most ",
                                                   kMaxTokenFileBytes, ")"));
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--auth_tokens_file=", path, ": read failed: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(n);
  }
  TokenFile out;
  auto tokens = ParseTokenFile(text, path);
  if (!tokens.ok()) return tokens.status();
  out.tokens = *std::move(tokens);
  if ((st.st_mode & (S_IROTH | S_IWOTH)) != 0) {
    out.warnings.push_back(absl::StrFormat(
        "--auth_tokens_file=%s has mode %04o: every user of this host can %s it; chmod 600 %s",
        path, st.st_mode & 07777, (st.st_mode & S_IWOTH) != 0 ? "change" : "read", path));
  }
  return out;
}

absl::Status ReloadTokenFile(const std::string& path, TokenChecker* checker,
                             std::vector<std::string>* warnings) {
  absl::StatusOr<TokenFile> file = ReadTokenFile(path);
  if (!file.ok()) return file.status();
  *warnings = std::move(file->warnings);
  checker->Replace(std::move(file->tokens));
  return absl::OkStatus();
}

TokenChecker::TokenChecker(std::vector<NamedToken> tokens)
    : entries_(MakeEntries(std::move(tokens))) {}

std::shared_ptr<const TokenChecker::Entries> TokenChecker::MakeEntries(
    std::vector<NamedToken> tokens) {
  auto entries = std::make_shared<Entries>();
  for (NamedToken& t : tokens) {
    Entry e;
    e.name = std::move(t.name);
    e.size = std::min(t.token.size(), kMaxTokenBytes);
    std::memcpy(e.padded.data(), t.token.data(), e.size);
    entries->push_back(std::move(e));
  }
  return entries;
}

void TokenChecker::Replace(std::vector<NamedToken> tokens) {
  std::shared_ptr<const Entries> fresh = MakeEntries(std::move(tokens));
  std::lock_guard<std::mutex> lock(mu_);
  entries_ = std::move(fresh);
}

size_t TokenChecker::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_->size();
}

absl::StatusOr<std::string> TokenChecker::Authenticate(
    std::optional<absl::string_view> authorization) const {
  if (!authorization.has_value()) {
    return absl::UnauthenticatedError(
        "missing bearer token: this target checks tokens (--auth_tokens_file); give the client "
        "one (Python Feed(token=...), C++ FeedOptions::token), sent as 'authorization: Bearer "
        "<token>'");
  }
  // RFC 6750: the scheme is case-insensitive.
  if (authorization->size() < kBearer.size() ||
      !absl::EqualsIgnoreCase(authorization->substr(0, kBearer.size()), kBearer)) {
    return absl::UnauthenticatedError(
        "missing bearer token: the call's authorization metadata is not 'Bearer <token>'");
  }
  const absl::string_view token = absl::StripAsciiWhitespace(authorization->substr(kBearer.size()));
  std::shared_ptr<const Entries> entries;
  {
    std::lock_guard<std::mutex> lock(mu_);
    entries = entries_;
  }
  std::array<unsigned char, kMaxTokenBytes> presented{};
  const bool fits = token.size() <= kMaxTokenBytes;
  if (fits) std::memcpy(presented.data(), token.data(), token.size());
  // Every entry is compared in full: neither the time nor the path taken
  // depends on where, or how far into a token, a guess goes wrong.
  const Entry* match = nullptr;
  for (const Entry& e : *entries) {
    unsigned diff = static_cast<unsigned>(e.size ^ token.size());
    for (size_t i = 0; i < kMaxTokenBytes; ++i) diff |= e.padded[i] ^ presented[i];
    const bool equal = fits && diff == 0;
    match = equal ? &e : match;
  }
  if (match == nullptr) {
    return absl::UnauthenticatedError(
        "unknown bearer token: it is not in this target's --auth_tokens_file (a token removed "
        "from the file stops working once the target re-reads it on SIGHUP)");
  }
  return match->name;
}

}  // namespace draftfeed
