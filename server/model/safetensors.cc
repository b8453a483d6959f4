#include "server/model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/file_kind.h"
#include "common/status_macros.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace draftfeed {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

// The reference implementation refuses larger headers; so do we, before parsing.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;
constexpr double kMaxExactInt = 9007199254740992.0;  // 2^53

struct DTypeInfo {
  std::string_view name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1},
    {"U16", 2},  {"I16", 2}, {"F16", 2}, {"BF16", 2},    {"U32", 4},     {"I32", 4},
    {"F32", 4},  {"U64", 8}, {"I64", 8}, {"F64", 8},
};

absl::Status ErrnoError(int err, absl::string_view what) {
  std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  return absl::InternalError(msg);
}

std::string Quote(std::string_view s) {
  Value v;
  v.set_string_value(std::string(s));
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(v, &out);
  return out;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// A JSON number that must be a non-negative integer.
bool ToCount(const Value& v, uint64_t* out) {
  if (v.kind_case() != Value::kNumberValue) return false;
  const double d = v.number_value();
  if (!std::isfinite(d) || d < 0 || std::trunc(d) != d || d > kMaxExactInt) return false;
  *out = static_cast<uint64_t>(d);
  return true;
}

struct Region {
  uint64_t begin, end;
  const std::string* name;
};

}  // namespace

absl::Status CheckRegularFile(const std::string& path, std::string_view what_view) {
  const absl::string_view what(what_view.data(), what_view.size());
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return ErrnoError(errno, absl::StrCat("cannot open ", what, " ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, ": not a regular file (", FileKind(st.st_mode),
                     "); reading it could block start-up or never end"));
  }
  return absl::OkStatus();
}

size_t SafetensorsDTypeSize(std::string_view dtype) {
  for (const DTypeInfo& d : kDTypes) {
    if (d.name == dtype) return d.size;
  }
  return 0;
}

DType DTypeFromSafetensors(std::string_view dtype) {
  if (dtype == "BF16") return DType::kBF16;
  if (dtype == "F16") return DType::kF16;
  if (dtype == "F32") return DType::kF32;
  if (dtype == "F8_E4M3") return DType::kF8E4M3;
  return DType::kInvalid;
}

const SafetensorsTensor* SafetensorsFile::Find(std::string_view name) const {
  auto it = tensors_.find(std::string(name));
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  auto fail = [&path](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors file ", path, ": ", parts...));
  };

  DF_RETURN_IF_ERROR(CheckRegularFile(path, "safetensors file"));
  // O_NONBLOCK: should a FIFO replace the file after the check, open returns
  // at once (and fstat refuses it) instead of waiting for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ErrnoError(errno, absl::StrCat("cannot open safetensors file ", path));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoError(err, absl::StrCat("cannot stat safetensors file ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return fail("not a regular file (", FileKind(st.st_mode), ")");
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    return fail("file is ", file_size, " bytes, too short for the 8-byte header length");
  }
  // The descriptor stays open with the mapping: bulk readers pread it.
  DF_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> mapping,
                      MappedFile::Map(fd, path, file_size));
  const std::byte* base = mapping->data();

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(base[i]);
  if (header_len > kMaxHeaderBytes) {
    return fail("header length ", header_len, " exceeds the ", kMaxHeaderBytes, "-byte limit");
  }
  if (header_len > file_size - 8) {
    return fail("header length ", header_len, " runs past the end of the file (", file_size,
                " bytes)");
  }
  const uint64_t data_size = file_size - 8 - header_len;
  const std::byte* data = base + 8 + header_len;

  Struct header;
  const auto parsed = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(reinterpret_cast<const char*>(base + 8), header_len), &header);
  if (!parsed.ok()) {
    return fail("header is not a valid JSON object: ",
                absl::string_view(parsed.message().data(), parsed.message().size()));
  }

  SafetensorsFile file;
  file.path_ = path;
  std::vector<Region> regions;
  for (const auto& [name, value] : header.fields()) {
    if (name == "__metadata__") {
      if (value.kind_case() != Value::kStructValue) return fail("__metadata__ is not an object");
      for (const auto& [key, v] : value.struct_value().fields()) {
        if (v.kind_case() != Value::kStringValue) {
          return fail("__metadata__ entry ", key, " is not a string");
        }
        file.metadata_[key] = v.string_value();
      }
      continue;
    }
    if (value.kind_case() != Value::kStructValue) {
      return fail("tensor ", name, ": header entry is not an object");
    }
    const auto& fields = value.struct_value().fields();
    SafetensorsTensor t;
    t.name = name;

    auto dtype_it = fields.find("dtype");
    if (dtype_it == fields.end() || dtype_it->second.kind_case() != Value::kStringValue) {
      return fail("tensor ", name, ": missing or non-string \"dtype\"");
    }
    t.dtype = dtype_it->second.string_value();
    const size_t elem_size = SafetensorsDTypeSize(t.dtype);
    if (elem_size == 0) return fail("tensor ", name, ": unknown dtype ", Quote(t.dtype));

    auto shape_it = fields.find("shape");
    if (shape_it == fields.end() || shape_it->second.kind_case() != Value::kListValue) {
      return fail("tensor ", name, ": missing or non-array \"shape\"");
    }
    uint64_t numel = 1;
    bool overflow = false;
    for (const Value& dim : shape_it->second.list_value().values()) {
      if (dim.kind_case() == Value::kNumberValue && dim.number_value() < 0) {
        return fail("tensor ", name, ": shape has a negative dimension ", dim.number_value());
      }
      uint64_t d = 0;
      if (!ToCount(dim, &d)) return fail("tensor ", name, ": shape entries must be integers");
      t.shape.push_back(static_cast<int64_t>(d));
      overflow |= __builtin_mul_overflow(numel, d, &numel);
    }
    uint64_t want_bytes = 0;
    overflow |= __builtin_mul_overflow(numel, static_cast<uint64_t>(elem_size), &want_bytes);
    if (overflow) return fail("tensor ", name, ": shape ", ShapeText(t.shape), " overflows");

    auto off_it = fields.find("data_offsets");
    uint64_t begin = 0, end = 0;
    if (off_it == fields.end() || off_it->second.kind_case() != Value::kListValue ||
        off_it->second.list_value().values_size() != 2 ||
        !ToCount(off_it->second.list_value().values(0), &begin) ||
        !ToCount(off_it->second.list_value().values(1), &end)) {
      return fail("tensor ", name, ": \"data_offsets\" must be two non-negative integers");
    }
    if (end < begin) {
      return fail("tensor ", name, ": data_offsets [", begin, ", ", end, "] end before they begin");
    }
    if (end - begin != want_bytes) {
      return fail("tensor ", name, ": shape ", ShapeText(t.shape), " of ", t.dtype, " is ",
                  want_bytes, " bytes but data_offsets [", begin, ", ", end, "] span ",
                  end - begin);
    }
    if (end > data_size) {
      return fail("tensor ", name, ": data_offsets [", begin, ", ", end,
                  "] run past the end of the data section (", data_size,
                  " bytes; file truncated?)");
    }
    t.data = data + begin;
    t.nbytes = static_cast<size_t>(want_bytes);
    auto [it, inserted] = file.tensors_.emplace(name, std::move(t));
    regions.push_back({begin, end, &it->first});
  }

  // The tensors must tile the data section exactly: every byte belongs to one
  // tensor. A gap or trailing bytes mean the offsets are not what the writer
  // meant (a header length shortened into the header's padding shifts every
  // tensor and still parses), so the weights would be garbage. Regions come in
  // any order in the JSON object; empty tensors own no bytes.
  std::sort(regions.begin(), regions.end(), [](const Region& a, const Region& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const Region* prev = nullptr;  // the last non-empty region
  uint64_t covered = 0;          // bytes [0, covered) belong to the regions so far
  for (const Region& cur : regions) {
    if (cur.end == cur.begin) continue;
    if (cur.begin < covered) {
      return fail("tensor ", *cur.name, " [", cur.begin, ", ", cur.end, ") overlaps tensor ",
                  *prev->name, " [", prev->begin, ", ", prev->end, ")");
    }
    if (cur.begin > covered) {
      return fail("tensor ", *cur.name, " [", cur.begin, ", ", cur.end, ") leaves bytes [", covered,
                  ", ", cur.begin, ") of the data section unused",
                  prev == nullptr ? std::string()
                                  : absl::StrCat(" after tensor ", *prev->name, " [", prev->begin,
                                                 ", ", prev->end, ")"),
                  "; tensors must be packed back to back");
    }
    covered = cur.end;
    prev = &cur;
  }
  if (covered != data_size) {
    return fail("the data section is ", data_size, " bytes but its tensors cover ", covered,
                prev == nullptr ? std::string()
                                : absl::StrCat(" (the last, tensor ", *prev->name, ", ends at ",
                                               prev->end, ")"),
                "; ", data_size - covered,
                " trailing bytes belong to no tensor (a header length that is too short, or "
                "bytes appended to the file)");
  }
  file.mapping_ = std::move(mapping);
  return file;
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsTensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  std::string header = "{";
  bool first = true;
  auto sep = [&]() -> absl::string_view {
    if (first) {
      first = false;
      return "";
    }
    return ",";
  };
  if (!metadata.empty()) {
    std::vector<std::string> kv;
    for (const auto& [k, v] : metadata) kv.push_back(absl::StrCat(Quote(k), ":", Quote(v)));
    absl::StrAppend(&header, sep(), "\"__metadata__\":{", absl::StrJoin(kv, ","), "}");
  }
  uint64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    const size_t elem_size = SafetensorsDTypeSize(t.dtype);
    if (elem_size == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("writing ", path, ": tensor ", t.name, ": unknown dtype ", Quote(t.dtype)));
    }
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "writing ", path, ": tensor ", t.name, ": negative dimension in ", ShapeText(t.shape)));
      }
      numel *= static_cast<uint64_t>(d);
    }
    if (numel * elem_size != t.nbytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("writing ", path, ": tensor ", t.name, ": shape ", ShapeText(t.shape),
                       " of ", t.dtype, " is ", numel * elem_size, " bytes, got ", t.nbytes));
    }
    absl::StrAppend(&header, sep(), Quote(t.name), ":{\"dtype\":", Quote(t.dtype),
                    ",\"shape\":", ShapeText(t.shape), ",\"data_offsets\":[", offset, ",",
                    offset + t.nbytes, "]}");
    offset += t.nbytes;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');

  // Written beside the target and renamed, so a reader never sees half a file.
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return ErrnoError(errno, absl::StrCat("cannot create ", tmp));
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(header.size() >> (8 * i));
  bool ok = std::fwrite(len_bytes, 1, 8, f) == 8 &&
            std::fwrite(header.data(), 1, header.size(), f) == header.size();
  for (const SafetensorsTensor& t : tensors) {
    if (!ok) break;
    if (t.nbytes > 0) ok = std::fwrite(t.data, 1, t.nbytes, f) == t.nbytes;
  }
  const int write_err = errno;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    return ErrnoError(write_err, absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return ErrnoError(err, absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace draftfeed
