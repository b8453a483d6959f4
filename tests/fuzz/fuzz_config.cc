// libFuzzer target: ModelConfig::FromJson on arbitrary config.json text. A
// refusal must name the file; an accepted config must pass Validate and
// survive the writer's round trip (ToJson, then FromJson) unchanged, since the
// checkpoint writer and the fingerprint rely on it.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "server/model/config.h"

namespace {

void Require(bool ok, const char* what, const std::string& detail = "") {
  if (!ok) {
    fprintf(stderr, "fuzz_config: invariant broken: %s\n%s\n", what, detail.c_str());
    abort();
  }
}

constexpr std::string_view kSource = "fuzz/config.json";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view json(reinterpret_cast<const char*>(data), size);
  auto cfg = draftfeed::ModelConfig::FromJson(json, kSource);
  if (!cfg.ok()) {
    const std::string msg(cfg.status().message());
    Require(msg.rfind(kSource, 0) == 0, "an error message that starts with the file", msg);
    return 0;
  }
  Require(cfg->Validate().ok(), "an accepted config validates", cfg->Validate().ToString());
  const std::string out = cfg->ToJson();
  auto back = draftfeed::ModelConfig::FromJson(out, "round trip");
  Require(back.ok(), "the written config reads back", back.status().ToString() + "\n" + out);
  Require(back->ToJson() == out, "the round trip is a fixed point", out);
  return 0;
}
