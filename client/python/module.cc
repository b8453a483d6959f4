// _draftfeed: the thin compiled half of the Python client. Every call returns
// (code, message, value); the pure-Python layer turns codes into exceptions.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>

#include "draftfeed/client.h"

namespace py = pybind11;

namespace draftfeed {
namespace {

// DLPack ABI (v0.x, the layout every framework's from_dlpack reads).
struct DLDevice {
  int32_t device_type;  // 1 = CPU, 2 = CUDA
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 1 = unsigned integer, 4 = bfloat
  uint8_t bits;
  uint16_t lanes;
};
constexpr uint8_t kDLUInt = 1;
constexpr uint8_t kDLBfloat = 4;
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

struct DlpackHolder {
  std::shared_ptr<HiddenBatch> batch;
  int64_t shape[3];  // [T, K, H]; raw rows (fp8_e4m3, target outputs): [T, bytes_per_token]
  DLManagedTensor managed;
};

void DeleteHolder(DLManagedTensor* t) { delete static_cast<DlpackHolder*>(t->manager_ctx); }

// The DLPack element type of a capture's encoding: bf16, or the raw bytes of
// an fp8_e4m3 capture (codes and scales interleaved per token, which the
// Python layer views apart).
DLDataType DlpackType(Encoding e) {
  switch (e) {
    case Encoding::kBf16:
      return DLDataType{kDLBfloat, 16, 1};
    case Encoding::kFp8E4m3:
      return DLDataType{kDLUInt, 8, 1};
  }
  throw py::value_error("draftfeed: encoding " + std::string(EncodingName(e)) + " (" +
                        std::to_string(static_cast<int>(e)) +
                        ") has no tensor type in this client");
}

py::tuple Ok(py::object value) { return py::make_tuple(0, "", std::move(value)); }
py::tuple Err(const absl::Status& s) {
  return py::make_tuple(static_cast<int>(s.code()), std::string(s.message()), py::none());
}

// A result shared between the numpy views and DLPack capsules handed out.
class PyResult {
 public:
  explicit PyResult(HiddenBatch b) : batch_(std::make_shared<HiddenBatch>(std::move(b))) {}

  uint64_t batch_id() const { return batch_->batch_id; }
  int64_t num_tokens() const { return batch_->num_tokens; }
  int64_t num_layers() const { return batch_->num_layers; }
  int64_t hidden_size() const { return batch_->hidden_size; }
  uint64_t checksum() const { return batch_->checksum; }
  std::string encoding() const { return std::string(EncodingName(batch_->encoding)); }
  int64_t bytes_per_token() const { return batch_->bytes_per_token; }
  std::string target() const { return batch_->target; }
  py::dict timings() const {
    py::dict d;
    d["queue_ms"] = batch_->queue_ms;
    d["forward_ms"] = batch_->forward_ms;
    d["send_ms"] = batch_->send_ms;
    d["recv_ms"] = batch_->recv_ms;
    return d;
  }

  py::array token_ids() const { return View(batch_->token_ids.data(), {batch_->token_ids.size()}); }
  py::array seq_lens() const { return View(batch_->seq_lens.data(), {batch_->seq_lens.size()}); }
  // -1 when the values are in host memory, else the CUDA device holding them.
  int device() const { return batch_->device; }
  // The capture's values [T, K, H] as the unsigned integers of their bit
  // patterns (uint16 for bf16), no copy (host results only).
  py::array hidden_bits() const {
    if (batch_->device >= 0) {
      throw py::value_error("this result is in GPU memory (cuda:" + std::to_string(batch_->device) +
                            "; transport nccl): use .torch() or DLPack, not numpy");
    }
    const std::vector<size_t> shape = {static_cast<size_t>(batch_->num_tokens),
                                       static_cast<size_t>(batch_->num_layers),
                                       static_cast<size_t>(batch_->hidden_size)};
    switch (batch_->encoding) {
      case Encoding::kBf16: {
        // Rows hold target outputs after the states when asked: stride by the row.
        const auto H = static_cast<ssize_t>(batch_->hidden_size);
        return StridedView(reinterpret_cast<const uint16_t*>(batch_->buffer.get()), shape,
                           {static_cast<ssize_t>(batch_->bytes_per_token), 2 * H, 2});
      }
      case Encoding::kFp8E4m3: {
        // The e4m3 codes, a strided view past each token's scales.
        const auto H = static_cast<ssize_t>(batch_->hidden_size);
        return StridedView(reinterpret_cast<const uint8_t*>(batch_->buffer.get()), shape,
                           {static_cast<ssize_t>(batch_->bytes_per_token), H, 1});
      }
    }
    throw py::value_error("draftfeed: encoding " + encoding() +
                          " has no numpy view in this client");
  }

  // An fp8_e4m3 result's scales [T, K] fp32 (host results only), no copy.
  py::array fp8_scales() const {
    if (batch_->encoding != Encoding::kFp8E4m3 || batch_->device >= 0) {
      throw py::value_error("fp8_scales: not an fp8_e4m3 result in host memory");
    }
    const auto K = static_cast<ssize_t>(batch_->num_layers);
    const auto H = static_cast<ssize_t>(batch_->hidden_size);
    // Little-endian fp32 at K*H + 4k of each token: aligned only when K*H is
    // a multiple of 4, which numpy views handle either way.
    return StridedView(reinterpret_cast<const float*>(batch_->buffer.get() + K * H),
                       {static_cast<size_t>(batch_->num_tokens), static_cast<size_t>(K)},
                       {static_cast<ssize_t>(batch_->bytes_per_token), 4});
  }

  // The result's rows as bytes [T, bytes_per_token], no copy (host results).
  py::array raw() const {
    if (batch_->device >= 0) {
      throw py::value_error("this result is in GPU memory: use dlpack_capsule(raw=True)");
    }
    return View(reinterpret_cast<const uint8_t*>(batch_->buffer.get()),
                {static_cast<size_t>(batch_->num_tokens),
                 static_cast<size_t>(batch_->bytes_per_token)});
  }
  // Where the target outputs sit in a row (offsets from its start; -1: not asked).
  py::dict outputs() const {
    const TargetOutputOffsets& o = batch_->outputs;
    py::dict d;
    d["argmax"] = o.argmax;
    d["top_k_ids"] = o.top_k_ids;
    d["top_k_logprobs"] = o.top_k_logprobs;
    d["probs_scale"] = o.probs_scale;
    d["probs"] = o.probs;
    d["top_k"] = o.top_k;
    d["num_draft"] = o.num_draft;
    d["probs_encoding"] = std::string(EncodingName(o.probs_encoding));
    return d;
  }

  // `raw`: the rows as bytes [T, bytes_per_token] (what fp8_e4m3 results and
  // rows with target outputs export, for the Python layer to view apart).
  py::capsule Dlpack(bool raw_rows) const {
    const bool rows = raw_rows || batch_->encoding == Encoding::kFp8E4m3 ||
                     batch_->outputs.probs >= 0 || batch_->outputs.argmax >= 0 ||
                     batch_->outputs.top_k_ids >= 0;
    const DLDataType dtype =  // throws before anything is made
        rows ? DLDataType{kDLUInt, 8, 1} : DlpackType(batch_->encoding);
    auto* h = new DlpackHolder;
    h->batch = batch_;
    h->shape[0] = batch_->num_tokens;
    h->shape[1] = rows ? batch_->bytes_per_token : batch_->num_layers;
    h->shape[2] = batch_->hidden_size;
    DLTensor& t = h->managed.dl_tensor;
    t.dtype = dtype;
    t.data = batch_->buffer.get();
    t.device = batch_->device >= 0 ? DLDevice{2, batch_->device} : DLDevice{1, 0};
    t.ndim = rows ? 2 : 3;
    t.shape = h->shape;
    t.strides = nullptr;  // compact row-major
    t.byte_offset = 0;
    h->managed.manager_ctx = h;
    h->managed.deleter = DeleteHolder;
    // A consumer renames the capsule to "used_dltensor" and owns the tensor;
    // an unconsumed capsule frees it here.
    return py::capsule(&h->managed, "dltensor", [](PyObject* cap) {
      if (PyCapsule_IsValid(cap, "dltensor")) {
        auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
        m->deleter(m);
      }
    });
  }

 private:
  template <typename T>
  py::array View(const T* data, std::vector<size_t> shape) const {
    auto* keep = new std::shared_ptr<HiddenBatch>(batch_);
    py::capsule base(keep, [](void* p) { delete static_cast<std::shared_ptr<HiddenBatch>*>(p); });
    py::array_t<T> a(shape, data, base);
    py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
    return a;
  }
  // The same with byte strides.
  template <typename T>
  py::array StridedView(const T* data, std::vector<size_t> shape,
                        std::vector<ssize_t> byte_strides) const {
    auto* keep = new std::shared_ptr<HiddenBatch>(batch_);
    py::capsule base(keep, [](void* p) { delete static_cast<std::shared_ptr<HiddenBatch>*>(p); });
    std::vector<ssize_t> dims(shape.begin(), shape.end());
    py::array a(py::dtype::of<T>(), dims, byte_strides, data, base);
    py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
    return a;
  }

  std::shared_ptr<HiddenBatch> batch_;
};

// Feed(tls=...) as draftfeed/tls.py hands it over: TlsOptions by field.
// Only a dict reaches here, so TLS is on.
TlsOptions TlsFromDict(const py::dict& d) {
  TlsOptions t;
  t.enabled = true;
  for (auto [key, value] : d) {
    const std::string k = py::cast<std::string>(key);
    if (k == "ca_file")
      t.ca_file = py::cast<std::string>(value);
    else if (k == "cert_file")
      t.cert_file = py::cast<std::string>(value);
    else if (k == "key_file")
      t.key_file = py::cast<std::string>(value);
    else if (k == "server_name")
      t.server_name = py::cast<std::string>(value);
    else
      throw py::value_error("unknown tls option: " + k);
  }
  return t;
}

py::dict DescriptionDict(const TargetDescription& d) {
  py::dict r;
  r["address"] = d.address;
  r["model_id"] = d.model_id;
  r["architecture"] = d.architecture;
  r["fingerprint"] = d.fingerprint;
  r["server_version"] = d.server_version;
  r["num_layers"] = d.num_layers;
  r["hidden_size"] = d.hidden_size;
  r["vocab_size"] = d.vocab_size;
  r["max_batch_tokens"] = d.max_batch_tokens;
  r["max_sequence_tokens"] = d.max_sequence_tokens;
  r["batch_invariant"] = d.batch_invariant;
  r["numerics"] = d.numerics;
  r["devices"] = d.devices;
  r["layer_types"] = d.layer_types;
  r["dtype"] = d.dtype;
  r["transports"] = d.transports;
  r["encodings"] = d.encodings;
  r["nccl_across_hosts"] = d.nccl_across_hosts;
  r["max_credits"] = d.max_credits;
  r["max_capture_layers"] = d.max_capture_layers;
  if (d.target_outputs.max_draft_vocab > 0) {
    py::dict offer;
    offer["max_top_k"] = d.target_outputs.max_top_k;
    offer["max_draft_vocab"] = d.target_outputs.max_draft_vocab;
    offer["draft_probs_encodings"] = d.target_outputs.draft_probs_encodings;
    r["target_outputs"] = offer;
  } else {
    r["target_outputs"] = py::none();
  }
  py::dict layout;
  layout["tp"] = d.layout.tp;
  layout["moe_parallel"] = d.layout.moe_parallel;
  layout["rank_weight_bytes"] = d.layout.rank_weight_bytes;
  r["layout"] = layout;
  return r;
}

Encoding EncodingFromName(const std::string& e, const char* what) {
  if (e == "bf16") return Encoding::kBf16;
  if (e == "fp8_e4m3") return Encoding::kFp8E4m3;
  throw py::value_error(std::string(what) + " must be 'bf16' or 'fp8_e4m3', got '" + e + "'");
}

std::vector<int32_t> ToInt32Vector(const py::array& a, const char* what) {
  py::array_t<int32_t, py::array::c_style | py::array::forcecast> arr(a);
  if (arr.ndim() != 1) {
    throw py::value_error(std::string(what) + " must be 1-D, got " + std::to_string(arr.ndim()) +
                          " dims");
  }
  return std::vector<int32_t>(arr.data(), arr.data() + arr.size());
}

class PyFeed {
 public:
  // `opts` holds FeedOptions fields by name; unknown keys are an error.
  static py::tuple Open(std::vector<std::string> targets, std::vector<int32_t> layers,
                        const py::dict& opts) {
    FeedOptions o;
    o.targets = std::move(targets);
    o.layers = std::move(layers);
    for (auto [key, value] : opts) {
      const std::string k = py::cast<std::string>(key);
      if (k == "prefetch")
        o.prefetch = py::cast<int32_t>(value);
      else if (k == "prefetch_bytes")
        o.prefetch_bytes = py::cast<int64_t>(value);
      else if (k == "ordered")
        o.ordered = py::cast<bool>(value);
      else if (k == "credits_per_target")
        o.credits_per_target = py::cast<int32_t>(value);
      else if (k == "connections_per_target")
        o.connections_per_target = py::cast<int32_t>(value);
      else if (k == "read_handoff") {
        if (!value.is_none()) o.read_handoff = py::cast<bool>(value);
      } else if (k == "expected_fingerprint")
        o.expected_fingerprint = py::cast<std::string>(value);
      else if (k == "verify_checksum")
        o.verify_checksum = py::cast<bool>(value);
      else if (k == "fp8_raw")
        o.fp8_raw = py::cast<bool>(value);
      else if (k == "encoding")
        o.encoding = EncodingFromName(py::cast<std::string>(value), "encoding");
      else if (k == "argmax")
        o.target_outputs.argmax = py::cast<bool>(value);
      else if (k == "top_k")
        o.target_outputs.top_k = py::cast<int32_t>(value);
      else if (k == "draft_vocab") {
        if (!value.is_none()) {
          o.target_outputs.draft_vocab =
              ToInt32Vector(py::cast<py::array>(value), "draft_vocab");
        }
      } else if (k == "probs_encoding")
        o.target_outputs.probs_encoding =
            EncodingFromName(py::cast<std::string>(value), "probs_encoding");
      else if (k == "connect_timeout_s")
        o.connect_timeout_s = py::cast<double>(value);
      else if (k == "batch_timeout_s")
        o.batch_timeout_s = py::cast<double>(value);
      else if (k == "unavailable_timeout_s")
        o.unavailable_timeout_s = py::cast<double>(value);
      else if (k == "reconnect_backoff_min_s")
        o.reconnect_backoff_min_s = py::cast<double>(value);
      else if (k == "reconnect_backoff_max_s")
        o.reconnect_backoff_max_s = py::cast<double>(value);
      else if (k == "dns_refresh_s")
        o.dns_refresh_s = py::cast<double>(value);
      else if (k == "stats_window_s")
        o.stats_window_s = py::cast<double>(value);
      else if (k == "client_name")
        o.client_name = py::cast<std::string>(value);
      else if (k == "tls") {
        if (!value.is_none()) o.tls = TlsFromDict(py::cast<py::dict>(value));
      } else if (k == "token")
        o.token = py::cast<std::string>(value);
      else if (k == "cuda_device")
        o.cuda_device = py::cast<int>(value);
      else if (k == "nccl_timeout_s")
        o.nccl_timeout_s = py::cast<double>(value);
      else if (k == "nccl_setup_timeout_s")
        o.nccl_setup_timeout_s = py::cast<double>(value);
      else if (k == "nccl_across_hosts")
        o.nccl_across_hosts = py::cast<bool>(value);
      else if (k == "nccl_socket_ifname")
        o.nccl_socket_ifname = py::cast<std::string>(value);
      else if (k == "transport") {
        const std::string t = py::cast<std::string>(value);
        if (t == "grpc")
          o.transport = Transport::kGrpc;
        else if (t == "nccl")
          o.transport = Transport::kNccl;
        else if (t == "auto")
          o.transport = Transport::kAuto;
        else
          throw py::value_error("transport must be 'grpc', 'nccl' or 'auto', got '" + t + "'");
      } else
        throw py::value_error("unknown Feed option: " + k);
    }
    absl::StatusOr<std::unique_ptr<Feed>> feed;
    {
      py::gil_scoped_release nogil;
      feed = Feed::Open(o);
    }
    if (!feed.ok()) return Err(feed.status());
    return Ok(py::cast(new PyFeed(*std::move(feed)), py::return_value_policy::take_ownership));
  }

  py::tuple AddTarget(const std::string& address) {
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      s = feed_->AddTarget(address);
    }
    if (!s.ok()) return Err(s);
    return Ok(py::none());
  }

  py::tuple Submit(const py::array& token_ids, const py::array& seq_lens) {
    std::vector<int32_t> tokens = ToInt32Vector(token_ids, "token_ids");
    std::vector<int32_t> lens = ToInt32Vector(seq_lens, "seq_lens");
    absl::StatusOr<uint64_t> id;
    {
      py::gil_scoped_release nogil;
      id = feed_->Submit(std::move(tokens), std::move(lens));
    }
    if (!id.ok()) return Err(id.status());
    return Ok(py::int_(*id));
  }

  py::tuple Next() {
    absl::StatusOr<HiddenBatch> b;
    {
      py::gil_scoped_release nogil;
      b = feed_->Next();
    }
    if (!b.ok()) return Err(b.status());
    return Ok(py::cast(PyResult(*std::move(b))));
  }

  int64_t Cancel(const std::vector<uint64_t>& batch_ids) {
    py::gil_scoped_release nogil;
    return feed_->Cancel(batch_ids);
  }

  py::tuple Close() {
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      s = feed_->Close();
    }
    if (!s.ok()) return Err(s);
    return Ok(py::none());
  }

  py::dict Stats() const {
    FeedStats s = feed_->Stats();
    py::dict d;
    d["submitted"] = s.submitted;
    d["delivered"] = s.delivered;
    d["failed"] = s.failed;
    d["resent"] = s.resent;
    d["duplicates_dropped"] = s.duplicates_dropped;
    d["cancelled"] = s.cancelled;
    d["tokens_delivered"] = s.tokens_delivered;
    d["bytes_received"] = s.bytes_received;
    d["buffer_allocations"] = s.buffer_allocations;
    d["outstanding"] = s.outstanding;
    d["outstanding_bytes"] = s.outstanding_bytes;
    d["waiting_dispatch"] = s.waiting_dispatch;
    d["live_targets"] = s.live_targets;
    d["elapsed_s"] = s.elapsed_s;
    d["batches_per_s"] = s.batches_per_s;
    d["tokens_per_s"] = s.tokens_per_s;
    d["bytes_per_s"] = s.bytes_per_s;
    d["window_s"] = s.window_s;
    d["window_batches_per_s"] = s.window_batches_per_s;
    d["window_tokens_per_s"] = s.window_tokens_per_s;
    d["window_bytes_per_s"] = s.window_bytes_per_s;
    d["closed"] = s.closed;
    py::list targets;
    for (const TargetStats& t : s.targets) {
      py::dict td;
      td["address"] = t.address;
      td["state"] = t.state;
      td["outstanding_batches"] = t.outstanding_batches;
      td["outstanding_tokens"] = t.outstanding_tokens;
      td["delivered_batches"] = t.delivered_batches;
      td["delivered_tokens"] = t.delivered_tokens;
      td["failures"] = t.failures;
      td["last_error"] = t.last_error;
      td["transport"] = t.transport;
      td["transport_note"] = t.transport_note;
      td["batches_per_s"] = t.batches_per_s;
      td["tokens_per_s"] = t.tokens_per_s;
      td["window_s"] = t.window_s;
      td["window_batches_per_s"] = t.window_batches_per_s;
      td["window_tokens_per_s"] = t.window_tokens_per_s;
      targets.append(td);
    }
    d["targets"] = targets;
    return d;
  }

  py::dict Target() const { return DescriptionDict(feed_->target()); }

 private:
  explicit PyFeed(std::unique_ptr<Feed> feed) : feed_(std::move(feed)) {}
  std::unique_ptr<Feed> feed_;
};

}  // namespace
}  // namespace draftfeed

PYBIND11_MODULE(_draftfeed, m) {
  using namespace draftfeed;
  m.doc() = "draftfeed compiled core; use the `draftfeed` package instead.";
  py::class_<PyResult>(m, "Result")
      .def_property_readonly("batch_id", &PyResult::batch_id)
      .def_property_readonly("num_tokens", &PyResult::num_tokens)
      .def_property_readonly("num_layers", &PyResult::num_layers)
      .def_property_readonly("hidden_size", &PyResult::hidden_size)
      .def_property_readonly("checksum", &PyResult::checksum)
      .def_property_readonly("encoding", &PyResult::encoding)
      .def_property_readonly("bytes_per_token", &PyResult::bytes_per_token)
      .def_property_readonly("target", &PyResult::target)
      .def_property_readonly("timings", &PyResult::timings)
      .def_property_readonly("token_ids", &PyResult::token_ids)
      .def_property_readonly("seq_lens", &PyResult::seq_lens)
      .def_property_readonly("hidden_bits", &PyResult::hidden_bits)
      .def_property_readonly("fp8_scales", &PyResult::fp8_scales)
      .def_property_readonly("device", &PyResult::device)
      .def_property_readonly("raw", &PyResult::raw)
      .def_property_readonly("outputs", &PyResult::outputs)
      .def("dlpack_capsule", &PyResult::Dlpack, py::arg("raw") = false);
  py::class_<PyFeed>(m, "Feed")
      .def_static("open", &PyFeed::Open)
      .def("submit", &PyFeed::Submit)
      .def("add_target", &PyFeed::AddTarget)
      .def("next", &PyFeed::Next)
      .def("cancel", &PyFeed::Cancel)
      .def("close", &PyFeed::Close)
      .def("stats", &PyFeed::Stats)
      .def("target", &PyFeed::Target);
  m.def("describe_target",
        [](const std::string& address, double timeout_s, py::object tls, const std::string& token) {
          const TlsOptions tls_options = tls.is_none() ? TlsOptions() : TlsFromDict(tls);
          absl::StatusOr<TargetDescription> d;
          {
            py::gil_scoped_release nogil;
            d = DescribeTarget(address, tls_options, token, timeout_s);
          }
          if (!d.ok()) return Err(d.status());
          return Ok(DescriptionDict(*d));
        });
}
