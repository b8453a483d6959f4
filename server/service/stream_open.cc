#include "server/service/stream_open.h"

#include <algorithm>
#include <span>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "server/model/engine.h"
#include "server/model/model.h"
#include "server/service/service_options.h"
#include "server/service/transport_registry.h"

namespace draftfeed {

namespace {

// The wire's name in the short form the client's options use ("fp8_e4m3").
std::string WireEncodingName(v1::Encoding e) {
  const std::string& full = v1::Encoding_Name(e);
  if (full.empty()) return absl::StrCat("unknown (", static_cast<int>(e), ")");
  return absl::AsciiStrToLower(absl::string_view(full).substr(sizeof("ENCODING_") - 1));
}

absl::StatusOr<CaptureEncoding> ResolveEncoding(const StreamContext& target, v1::Encoding asked) {
  // ENCODING_UNSPECIFIED is what an older client sends: bf16, the first encoding.
  const v1::Encoding wire = asked == v1::ENCODING_UNSPECIFIED ? v1::ENCODING_BF16 : asked;
  const std::vector<CaptureEncoding>& served = target.encodings;
  const std::optional<CaptureEncoding> encoding = EncodingFromWire(wire);
  if (encoding.has_value() && std::find(served.begin(), served.end(), *encoding) != served.end()) {
    return *encoding;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("encoding ", WireEncodingName(wire), " is not served by this target; offered: ",
                   absl::StrJoin(served, ", ", [](std::string* out, CaptureEncoding e) {
                     absl::StrAppend(out, std::string(EncodingName(e)));
                   })));
}

absl::Status ValidateLayers(const ModelConfig& config, std::span<const int32_t> layers,
                            const TargetOutputs* outputs) {
  // Token checks need a batch; reuse the shared validator with one token.
  const int32_t token = 0;
  const int32_t len = 1;
  ForwardInput in{{&token, 1}, {&len, 1}, layers};
  in.outputs = outputs;
  return ValidateForwardInput(config, in, 1);
}

// OK when a batch of `asked` capture layers is within the engines' limit
// (`most`, 0 = none), else the error naming TargetInfo.max_capture_layers.
absl::Status CheckCaptureLayers(int64_t most, size_t asked) {
  if (most == 0 || static_cast<int64_t>(asked) <= most) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(asked, " capture layers asked; this target captures at most ", most,
                   " per batch (TargetInfo.max_capture_layers; start it with a larger "
                   "--max_capture_layers)"));
}

// Open.target_outputs as the engines take it; null when it asks nothing.
absl::StatusOr<std::shared_ptr<const TargetOutputs>> PlanTargetOutputs(
    const StreamContext& target, const v1::TargetOutputs& asked) {
  auto outputs = std::make_shared<TargetOutputs>();
  outputs->argmax = asked.argmax();
  outputs->top_k = asked.top_k();
  outputs->draft_vocab.assign(asked.draft_vocab().begin(), asked.draft_vocab().end());
  const v1::Encoding wire = asked.draft_probs_encoding() == v1::ENCODING_UNSPECIFIED
                                ? v1::ENCODING_BF16
                                : asked.draft_probs_encoding();
  if (wire != v1::ENCODING_BF16 && wire != v1::ENCODING_FP8_E4M3) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_outputs.draft_probs_encoding ", WireEncodingName(wire),
                     " is not offered for draft probabilities; offered: bf16, fp8_e4m3"));
  }
  outputs->probs_encoding = *EncodingFromWire(wire);
  if (outputs->empty()) return std::shared_ptr<const TargetOutputs>();
  DF_RETURN_IF_ERROR(ValidateTargetOutputs(*outputs, target.model.config.vocab_size));
  if (!target.serves_target_outputs) {
    return absl::FailedPreconditionError(absl::StrCat(
        "target_outputs (argmax, top_k, draft_vocab) asked, but this target cannot compute them: ",
        target.model.id, " has no lm_head (its checkpoint stores none and does not tie it to "
        "the embedding); TargetInfo.target_outputs is absent on such targets"));
  }
  return std::shared_ptr<const TargetOutputs>(std::move(outputs));
}

// Open.client_name goes into log lines and metric labels as it is: a newline
// in it forged log lines and an 8 MiB name wrote 16 MB of stderr. Refused:
// a name over kMaxClientNameBytes, or one holding a control character (C0,
// DEL, or C1 as UTF-8; proto3 has already checked the UTF-8 itself).
absl::Status CheckClientName(const std::string& name) {
  if (name.size() > kMaxClientNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("Open.client_name has ", name.size(),
                                                   " bytes; at most ", kMaxClientNameBytes));
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    const bool c1 = c == 0xc2 && i + 1 < name.size() &&
                    static_cast<unsigned char>(name[i + 1]) >= 0x80 &&
                    static_cast<unsigned char>(name[i + 1]) <= 0x9f;
    if (c < 0x20 || c == 0x7f || c1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Open.client_name holds a control character at byte ", i,
          "; it names the client in log lines and metric labels: printable text only"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StreamPlan> PlanStream(const StreamContext& target, const v1::Open& open) {
  const Model& model = target.model;
  if (!open.expected_fingerprint().empty() && open.expected_fingerprint() != model.fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model fingerprint mismatch: the client expects ", open.expected_fingerprint(),
        " but this target serves ", model.id, " with fingerprint ", model.fingerprint));
  }
  DF_RETURN_IF_ERROR(CheckClientName(open.client_name()));
  StreamPlan plan;
  DF_ASSIGN_OR_RETURN(plan.encoding, ResolveEncoding(target, open.encoding()));
  DF_RETURN_IF_ERROR(CheckTransportKnown(open.transport()));
  plan.layers.assign(open.layers().begin(), open.layers().end());
  DF_ASSIGN_OR_RETURN(plan.outputs, PlanTargetOutputs(target, open.target_outputs()));
  DF_RETURN_IF_ERROR(ValidateLayers(model.config, plan.layers, plan.outputs.get()));
  DF_RETURN_IF_ERROR(CheckCaptureLayers(target.max_capture_layers, plan.layers.size()));
  const ServiceOptions& opt = target.options;
  plan.credits = open.max_inflight_batches() <= 0
                     ? opt.default_credits
                     : std::min(open.max_inflight_batches(), opt.max_credits);
  return plan;
}

absl::StatusOr<BatchPlan> PlanBatch(const StreamContext& target, const StreamPlan& stream,
                                    const v1::Batch& batch) {
  BatchPlan out;
  out.token_ids.assign(batch.token_ids().begin(), batch.token_ids().end());
  out.seq_lens.assign(batch.seq_lens().begin(), batch.seq_lens().end());
  if (batch.layers_size() > 0) {
    out.layers.assign(batch.layers().begin(), batch.layers().end());
  } else {
    out.layers = stream.layers;
  }
  out.encoding = stream.encoding;
  out.outputs = stream.outputs;
  ForwardInput in{out.token_ids, out.seq_lens, out.layers, out.encoding};
  in.outputs = out.outputs.get();
  const int64_t limit = target.max_sequence_tokens;
  absl::Status valid;
  if (static_cast<int64_t>(out.token_ids.size()) > limit) {
    const int64_t forward = target.options.max_batch_tokens;
    valid = absl::InvalidArgumentError(
        limit > forward
            ? absl::StrCat("it has ", out.token_ids.size(), " tokens, over this target's ",
                           limit, " (--max_sequence_tokens; a forward takes ", forward,
                           " and longer batches run in chunks); send fewer tokens")
            : absl::StrCat("it has ", out.token_ids.size(), " tokens, over this target's ",
                           "--max_batch_tokens of ", forward,
                           " (it does not run longer batches in chunks: see "
                           "--max_sequence_tokens); split it into smaller batches"));
  } else {
    valid = ValidateForwardInput(target.model.config, in, limit);
  }
  if (valid.ok()) valid = CheckCaptureLayers(target.max_capture_layers, out.layers.size());
  if (!valid.ok()) {
    return absl::Status(valid.code(),
                        absl::StrCat("batch ", batch.batch_id(), ": ", valid.message()));
  }
  return out;
}

}  // namespace draftfeed
