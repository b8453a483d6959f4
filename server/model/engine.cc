#include "server/model/engine.h"

#include <algorithm>
#include <string>
#include <unordered_map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace draftfeed {

absl::Status CheckCarriedInput(const ForwardInput& in, int64_t carried_tokens, int64_t max_tokens,
                               const std::string& device) {
  if (!in.chunked()) return absl::OkStatus();
  if (max_tokens <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(device, " carries no sequence across forwards (chunked prefill is off)"));
  }
  if (in.resume_tokens != carried_tokens) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the batch resumes a sequence ", in.resume_tokens, " tokens in, but ", device,
        " carries ", carried_tokens, " (a batch's chunks run in order on one engine)"));
  }
  const int64_t first = in.resume_tokens + in.seq_lens.front();
  if (first > max_tokens || TokensCarriedAfter(in) > max_tokens) {
    return absl::FailedPreconditionError(
        absl::StrCat("a sequence of ", std::max(first, TokensCarriedAfter(in)), " tokens is over the ",
                     max_tokens, " ", device, " can carry"));
  }
  return absl::OkStatus();
}

int64_t TokensCarriedAfter(const ForwardInput& in) {
  if (!in.carry_last || in.seq_lens.empty()) return 0;
  const int64_t last = in.seq_lens.back();
  return in.seq_lens.size() == 1 ? in.resume_tokens + last : last;
}

absl::Status ValidateForwardInput(const ModelConfig& config, const ForwardInput& in,
                                  int64_t max_tokens) {
  const int64_t num_tokens = static_cast<int64_t>(in.token_ids.size());
  if (num_tokens == 0 || in.seq_lens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "empty batch: token_ids has ", num_tokens, " tokens and seq_lens has ", in.seq_lens.size(),
        " entries; send at least one sequence of at least one token"));
  }
  int64_t total = 0;
  for (size_t i = 0; i < in.seq_lens.size(); ++i) {
    if (in.seq_lens[i] < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "seq_lens[", i, "] is ", in.seq_lens[i], "; every sequence must hold at least 1 token"));
    }
    total += in.seq_lens[i];
  }
  if (total != num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("seq_lens add up to ", total,
                                                   " tokens but token_ids has ", num_tokens,
                                                   "; they must be equal"));
  }
  if (in.resume_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("resume_tokens is ", in.resume_tokens, "; it must be >= 0"));
  }
  if (num_tokens > max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("batch has ", num_tokens,
                                                   " tokens, over the token budget of ", max_tokens,
                                                   "; split it into smaller batches"));
  }
  for (int64_t i = 0; i < num_tokens; ++i) {
    const int32_t id = in.token_ids[i];
    if (id < 0 || id >= config.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_ids[", i, "] = ", id, " is outside the vocabulary of ",
                       config.vocab_size, " (valid ids are 0..", config.vocab_size - 1, ")"));
    }
  }
  const std::string valid_layers =
      absl::StrCat("valid layer ids are -1 (final norm) and 0..", config.num_layers - 1);
  if (in.layers.empty() && !in.wants_outputs()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "no layers to capture: layers is empty and no target outputs are asked; ", valid_layers));
  }
  if (in.outputs != nullptr) DF_RETURN_IF_ERROR(ValidateTargetOutputs(*in.outputs, config.vocab_size));
  std::unordered_map<int32_t, size_t> first_seen;
  for (size_t i = 0; i < in.layers.size(); ++i) {
    const int32_t id = in.layers[i];
    if (id < kFinalLayerId || id >= config.num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("layers[", i, "] = ", id, " is not a layer of this model; ", valid_layers));
    }
    const auto [it, inserted] = first_seen.emplace(id, i);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat("layers[", i, "] = ", id, " repeats layers[",
                                                     it->second, "]; ask for each layer once"));
    }
  }
  return absl::OkStatus();
}

int64_t RowBytesPerToken(const ModelConfig& config, const ForwardInput& in) {
  const int64_t hidden = CaptureBytesPerToken(in.encoding, static_cast<int64_t>(in.layers.size()),
                                              config.hidden_size);
  return hidden + (in.wants_outputs() ? LayoutOf(*in.outputs).bytes : 0);
}

size_t CaptureBytes(const ModelConfig& config, const ForwardInput& in) {
  return in.token_ids.size() * static_cast<size_t>(RowBytesPerToken(config, in));
}

absl::Status CheckOutputsServed(const Engine& engine, const ForwardInput& in) {
  if (!in.wants_outputs() || engine.serves_target_outputs()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "target outputs (argmax, top_k, draft_vocab) are not served by ", engine.device_name(),
      ": the model has no lm_head (the checkpoint stores none and does not tie it to the "
      "embedding)"));
}

absl::Status CheckEncodingServed(const Engine& engine, CaptureEncoding encoding) {
  const std::vector<CaptureEncoding> served = engine.encodings();
  if (std::find(served.begin(), served.end(), encoding) != served.end()) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "encoding ", std::string(EncodingName(encoding)), " (", static_cast<int>(encoding),
      ") is not served by ", engine.device_name(), "; it serves ",
      absl::StrJoin(served, ", ", [](std::string* out, CaptureEncoding e) {
        absl::StrAppend(out, std::string(EncodingName(e)));
      })));
}

absl::Status CheckCaptureOutput(const Engine& engine, const ForwardInput& in, size_t out_bytes) {
  DF_RETURN_IF_ERROR(CheckEncodingServed(engine, in.encoding));
  DF_RETURN_IF_ERROR(CheckOutputsServed(engine, in));
  const size_t need = CaptureBytes(engine.model().config, in);
  if (out_bytes != need) {
    return absl::InvalidArgumentError(absl::StrCat(
        "output has ", out_bytes, " bytes; the ", std::string(EncodingName(in.encoding)),
        " capture of ", in.token_ids.size(), " tokens x ", in.layers.size(), " layers x ",
        engine.model().config.hidden_size, " values",
        in.wants_outputs() ? " with its target outputs" : "", " takes ", need));
  }
  return absl::OkStatus();
}

}  // namespace draftfeed
