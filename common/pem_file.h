// Reading the PEM files of TLS options (the target's --tls_* flags, the
// client's TlsOptions) with errors that name the option and the file.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace draftfeed {

// The contents of `path`, which must hold a PEM block whose label ends in
// `label` ("CERTIFICATE", "PRIVATE KEY"). gRPC's OpenSSL parses it later;
// this turns the commonest mistakes (a wrong path, the key given as the
// certificate, a DER file) into INVALID_ARGUMENT naming `option` and `path`
// instead of a failed handshake. Only a regular file of at most 1 MiB is
// read (checked before reading, so a FIFO or /dev/zero fails at once naming
// the file and the limit instead of hanging or filling memory).
absl::StatusOr<std::string> ReadPemFile(absl::string_view option, const std::string& path,
                                        absl::string_view label);

}  // namespace draftfeed
