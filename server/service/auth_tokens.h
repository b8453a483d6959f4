// Bearer tokens of a target (--auth_tokens_file): the file's format, its
// reading, and the check every call but health makes. The file holds one
// named token a line:
//
//   # trainers of run 42
//   trainer-a: 3f9c0d6e1b7a48f2a1c5e0b9d8f7a6c5
//
// The name is what the target's logs show for a stream; the token never
// appears in a log or an error message.
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace draftfeed {

// Tokens are printable ASCII without spaces (an HTTP/2 header value), of a
// length that resists guessing and fits the constant-time comparison.
inline constexpr size_t kMinTokenBytes = 16;
inline constexpr size_t kMaxTokenBytes = 256;

struct NamedToken {
  std::string name;
  std::string token;
};

// The tokens of a token file's `text`; `path` names it in errors, with the
// line number (never the token itself). Refused: a line that is not
// `name: token`, a bad name or token, a repeated name or token, no token.
absl::StatusOr<std::vector<NamedToken>> ParseTokenFile(absl::string_view text,
                                                       absl::string_view path);

struct TokenFile {
  std::vector<NamedToken> tokens;
  // e.g. that other users may read the file; for the log, not fatal.
  std::vector<std::string> warnings;
};

// Reads and parses the token file at `path` (a regular file).
absl::StatusOr<TokenFile> ReadTokenFile(const std::string& path);

// The set of tokens a target accepts. Thread-safe: Replace (on SIGHUP) swaps
// the whole set at once; calls authenticated before keep their name.
class TokenChecker;

// SIGHUP: re-reads `path` into `checker`, the new set applying to calls that
// start from then on. On an error the old set stays (and the error says why);
// on success `warnings` receives the new file's warnings.
absl::Status ReloadTokenFile(const std::string& path, TokenChecker* checker,
                             std::vector<std::string>* warnings);

class TokenChecker {
 public:
  explicit TokenChecker(std::vector<NamedToken> tokens);

  void Replace(std::vector<NamedToken> tokens);
  size_t size() const;

  // The name of the token that the call's `authorization` metadata carries
  // ("Bearer <token>"; nullopt: the call has none). UNAUTHENTICATED "missing
  // bearer token" or "unknown bearer token" otherwise.
  absl::StatusOr<std::string> Authenticate(std::optional<absl::string_view> authorization) const;

 private:
  // Tokens zero-padded to kMaxTokenBytes, so that every comparison reads the
  // same number of bytes whatever the lengths.
  struct Entry {
    std::string name;
    std::array<unsigned char, kMaxTokenBytes> padded{};
    size_t size = 0;
  };
  using Entries = std::vector<Entry>;
  static std::shared_ptr<const Entries> MakeEntries(std::vector<NamedToken> tokens);

  mutable std::mutex mu_;
  std::shared_ptr<const Entries> entries_;  // guarded by mu_; the set itself is immutable
};

}  // namespace draftfeed
