#include "server/service/auth_tokens.h"

#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace draftfeed {
namespace {

constexpr char kA[] = "aaaaaaaaaaaaaaaaaaaaaaaa";  // 24 characters
constexpr char kB[] = "0123456789abcdef0123456789abcdef";

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST(ParseTokenFile, NamesTokensSkippingCommentsBlankLinesAndSpaces) {
  auto tokens = ParseTokenFile(
      "# trainers\n\n  trainer-a:   aaaaaaaaaaaaaaaaaaaaaaaa  \r\nrun_42.b:" + std::string(kB) +
          "\n   # indented comment\n",
      "tokens.txt");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), 2u);
  EXPECT_EQ((*tokens)[0].name, "trainer-a");
  EXPECT_EQ((*tokens)[0].token, kA);
  EXPECT_EQ((*tokens)[1].name, "run_42.b");
  EXPECT_EQ((*tokens)[1].token, kB);
}

TEST(ParseTokenFile, RefusesBadLinesNamingFileAndLineButNeverTheToken) {
  struct Case {
    std::string text;
    std::string message;
  };
  const Case cases[] = {
      {"# x\njust-a-token-with-no-name-here\n",
       "t.txt:2: expected 'name: token' (a line of its own for each token, # for comments)"},
      {": aaaaaaaaaaaaaaaaaaaaaaaa\n", "t.txt:1: token name '' must be 1 to 64 letters"},
      {"a b: aaaaaaaaaaaaaaaaaaaaaaaa\n", "t.txt:1: token name 'a b' must be 1 to 64 letters"},
      {"x: short\n", "t.txt:1: the token of 'x' has 5 characters; tokens have 16 to 256"},
      {"x: " + std::string(257, 'z') + "\n", "t.txt:1: the token of 'x' has 257 characters"},
      {"x: aaaaaaaa aaaaaaaaaaaaaaaaa\n",
       "t.txt:1: the token of 'x' holds a space or a character that is not printable ASCII"},
      {"x: aaaaaaaaaaaaaaaaaaaaaaaa\nx: " + std::string(kB) + "\n",
       "t.txt:2: token name 'x' appears twice"},
      {"x: aaaaaaaaaaaaaaaaaaaaaaaa\ny: aaaaaaaaaaaaaaaaaaaaaaaa\n",
       "t.txt:2: the token of 'y' is also the token of 'x'; give each its own"},
      {"# nothing\n\n", "t.txt: no tokens (a target with none would refuse every call)"},
  };
  for (const Case& c : cases) {
    auto tokens = ParseTokenFile(c.text, "t.txt");
    ASSERT_FALSE(tokens.ok()) << c.text;
    EXPECT_EQ(tokens.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(Message(tokens.status()).rfind(c.message, 0), 0u)
        << Message(tokens.status()) << "\nexpected to start with: " << c.message;
    EXPECT_EQ(Message(tokens.status()).find("aaaaaaaa"), std::string::npos)
        << "a token leaked into: " << Message(tokens.status());
  }
}

TEST(TokenChecker, NamesTheTokenAndRefusesMissingMalformedAndUnknownOnes) {
  TokenChecker checker({{"trainer-a", kA}, {"trainer-b", kB}});
  EXPECT_EQ(checker.Authenticate("Bearer " + std::string(kA)).value(), "trainer-a");
  EXPECT_EQ(checker.Authenticate("bearer " + std::string(kB)).value(), "trainer-b");

  const auto missing = checker.Authenticate(std::nullopt);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Message(missing.status()).rfind("missing bearer token", 0), 0u);
  const auto basic = checker.Authenticate("Basic dXNlcjpwYXNz");
  EXPECT_EQ(basic.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Message(basic.status()).rfind("missing bearer token", 0), 0u);

  // A prefix, an extension, one changed last character, a token far too
  // long, and nothing at all after the scheme: all unknown.
  const std::string a(kA);
  for (const std::string& guess :
       {a.substr(0, a.size() - 1), a + "a", a.substr(0, a.size() - 1) + "b", std::string(300, 'a'),
        std::string()}) {
    const auto r = checker.Authenticate("Bearer " + guess);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnauthenticated) << guess;
    EXPECT_EQ(Message(r.status()).rfind("unknown bearer token", 0), 0u) << guess;
    EXPECT_EQ(Message(r.status()).find("aaaa"), std::string::npos) << Message(r.status());
  }
}

TEST(TokenChecker, ReplaceSwapsTheWholeSet) {
  TokenChecker checker(std::vector<NamedToken>{{"old", kA}});
  checker.Replace(std::vector<NamedToken>{{"new", kB}});
  EXPECT_EQ(checker.size(), 1u);
  EXPECT_EQ(checker.Authenticate("Bearer " + std::string(kB)).value(), "new");
  EXPECT_EQ(checker.Authenticate("Bearer " + std::string(kA)).status().code(),
            absl::StatusCode::kUnauthenticated);
}

class TokenFileTest : public ::testing::Test {
 protected:
  void Write(const std::string& text, mode_t mode) {
    std::ofstream(path_) << text;
    ASSERT_EQ(::chmod(path_.c_str(), mode), 0);
  }
  void TearDown() override { std::remove(path_.c_str()); }
  const std::string path_ = ::testing::TempDir() + "/draftfeed_tokens_test.txt";
};

TEST_F(TokenFileTest, WarnsWhenEveryUserCanReadIt) {
  Write("a: aaaaaaaaaaaaaaaaaaaaaaaa\n", 0644);
  auto file = ReadTokenFile(path_);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->warnings.size(), 1u);
  EXPECT_EQ(file->warnings[0], "--auth_tokens_file=" + path_ +
                                   " has mode 0644: every user of this host can read it; chmod "
                                   "600 " +
                                   path_);
  Write("a: aaaaaaaaaaaaaaaaaaaaaaaa\n", 0600);
  file = ReadTokenFile(path_);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->warnings.empty());
}

TEST_F(TokenFileTest, ReloadKeepsTheOldSetWhenTheNewFileIsBad) {
  Write("a: aaaaaaaaaaaaaaaaaaaaaaaa\n", 0600);
  auto file = ReadTokenFile(path_);
  ASSERT_TRUE(file.ok()) << file.status();
  TokenChecker checker(file->tokens);
  std::vector<std::string> warnings;

  Write("a: too-short\n", 0600);
  const absl::Status bad = ReloadTokenFile(path_, &checker, &warnings);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(bad), path_ + ":1: the token of 'a' has 9 characters; tokens have 16 to 256 " +
                              "(e.g. openssl rand -hex 32)");
  EXPECT_EQ(checker.Authenticate("Bearer " + std::string(kA)).value(), "a");

  Write("b: " + std::string(kB) + "\n", 0600);
  ASSERT_TRUE(ReloadTokenFile(path_, &checker, &warnings).ok());
  EXPECT_EQ(checker.Authenticate("Bearer " + std::string(kB)).value(), "b");
  EXPECT_FALSE(checker.Authenticate("Bearer " + std::string(kA)).ok());
}

TEST(ReadTokenFile, RefusesWhatIsNotARegularFile) {
  EXPECT_EQ(Message(ReadTokenFile("/nonexistent/tokens").status()),
            "--auth_tokens_file=/nonexistent/tokens: cannot open: No such file or directory");
  EXPECT_EQ(Message(ReadTokenFile("/").status()), "--auth_tokens_file=/: not a regular file");
}

}  // namespace
}  // namespace draftfeed
