#include "server/service/call_auth.h"

#include <chrono>
#include <cstdio>
#include <mutex>
#include <optional>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/log_line.h"

namespace draftfeed {
namespace {

// "ENCODING_BF16" -> "bf16": the names the clients' options use.
std::string ShortName(const std::string& wire, absl::string_view prefix) {
  absl::string_view name = wire;
  if (name.empty()) return "unknown";
  absl::ConsumePrefix(&name, prefix);
  return absl::AsciiStrToLower(name);
}

void LogRefusal(const grpc::CallbackServerContext& ctx, absl::string_view method,
                const absl::Status& why) {
  static std::mutex mu;
  static std::chrono::steady_clock::time_point last{};
  static long long suppressed = 0;
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu);
  if (last != std::chrono::steady_clock::time_point{} && now - last < std::chrono::seconds(1)) {
    ++suppressed;
    return;
  }
  last = now;
  const std::string more =
      suppressed > 0 ? " (and " + std::to_string(suppressed) + " more refusals before it)" : "";
  // The message holds no token: only why it was refused.
  LogF("draftfeed-target: refused %.*s from %s: %.*s%s", static_cast<int>(method.size()),
       method.data(), ctx.peer().c_str(), static_cast<int>(why.message().size()),
       why.message().data(), more.c_str());
  suppressed = 0;
}

}  // namespace

absl::StatusOr<std::string> AuthenticateCall(const TokenChecker* tokens,
                                             const grpc::CallbackServerContext& ctx,
                                             absl::string_view method) {
  if (tokens == nullptr) return std::string();
  std::optional<absl::string_view> authorization;
  const auto& md = ctx.client_metadata();
  if (auto it = md.find("authorization"); it != md.end()) {
    authorization = absl::string_view(it->second.data(), it->second.size());
  }
  absl::StatusOr<std::string> name = tokens->Authenticate(authorization);
  if (!name.ok()) LogRefusal(ctx, method, name.status());
  return name;
}

void LogStreamOpened(const grpc::CallbackServerContext& ctx, absl::string_view token_name,
                     const v1::Open& open, const v1::Opened& opened) {
  std::string who;
  if (!token_name.empty()) absl::StrAppend(&who, " token ", token_name);
  if (std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
      auth != nullptr && auth->IsPeerAuthenticated()) {
    std::vector<std::string> ids;
    for (const grpc::string_ref& id : auth->GetPeerIdentity())
      ids.emplace_back(id.data(), id.size());
    absl::StrAppend(&who, " certificate ", absl::StrJoin(ids, ","));
  }
  if (!open.client_name().empty()) absl::StrAppend(&who, " client '", open.client_name(), "'");
  std::string outputs;  // what lm_head adds to each token, when asked
  if (opened.target_outputs_bytes() > 0) {
    const v1::TargetOutputs& o = opened.target_outputs();
    std::vector<std::string> parts;
    if (o.argmax()) parts.push_back("argmax");
    if (o.top_k() > 0) parts.push_back(absl::StrCat("top ", o.top_k()));
    if (o.draft_vocab_size() > 0) {
      parts.push_back(absl::StrCat(
          "draft probs over ", o.draft_vocab_size(), " ids ",
          ShortName(v1::Encoding_Name(o.draft_probs_encoding()), "ENCODING_")));
    }
    outputs = absl::StrCat(", target outputs ", absl::StrJoin(parts, " + "), " (",
                           opened.target_outputs_bytes(), " bytes a token)");
  }
  LogF(
      "draftfeed-target: stream opened from %s%s: layers %s, %s%s, transport %s%s, %d "
      "credits",
      ctx.peer().c_str(), who.c_str(), absl::StrJoin(opened.layers(), ",").c_str(),
      ShortName(v1::Encoding_Name(opened.encoding()), "ENCODING_").c_str(), outputs.c_str(),
      ShortName(v1::Transport_Name(opened.transport()), "TRANSPORT_").c_str(),
      opened.transport_note().empty() ? ""
                                      : absl::StrCat(" (", opened.transport_note(), ")").c_str(),
      opened.max_inflight_batches());
}

}  // namespace draftfeed
