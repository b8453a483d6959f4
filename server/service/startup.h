// draftfeed-target's command line, checked where a mistake would otherwise
// show late (after a model load of minutes) or as gRPC's raw log lines:
// --help and --version, the --listen address, the --port_file.
#pragma once

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace draftfeed {

// What draftfeed-target's flags report as their file, in place of the build
// machine's path of main.cc (absl prints it in its help and matches on it).
inline constexpr absl::string_view kTargetFlagsFile = "draftfeed-target";
std::string NormalizeFlagFile(absl::string_view path);

// --help (-h, --helpshort, --helpfull) or --version among the arguments
// before a "--": prints the help or the version to stdout and returns 0, the
// exit code; nullopt when neither is asked for. absl's own --help exits 1.
std::optional<int> HandleTargetHelpOrVersion(int argc, char** argv);
// The help: the usage message, every built-in model, and every flag whose
// file is kTargetFlagsFile with its default, grouped by purpose (model,
// serving, security, limits, devices, observability).
std::string TargetHelp();
// A mistyped flag, before absl's parse: "unknown flag --max_batch_token; did
// you mean --max_batch_tokens?" (absl's own error names no flag to use).
absl::Status CheckTargetFlagNames(int argc, char** argv);

// --listen: "host:port", "[v6]:port" or "unix:path". The host must resolve
// and the port be free on it (port 0: any free one), each named on failure.
absl::Status CheckListenAddress(const std::string& listen);

// --port_file: its directory must take a file, checked before the model
// loads (the check's file is removed again).
absl::Status CheckPortFile(const std::string& path);
// Writes the bound port to `path` atomically (a temporary file renamed).
absl::Status WritePortFile(const std::string& path, int port);

}  // namespace draftfeed
