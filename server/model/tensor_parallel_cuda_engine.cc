#include "server/model/tensor_parallel_cuda_engine.h"

#include <algorithm>
#include <limits>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "server/model/device_all_reduce.h"
#include "server/model/weight_layout.h"

namespace draftfeed {
namespace {

// A rank's tensors of a real-size random model: shapes and dtypes, no host
// data (the rank's CudaEngine draws them on its GPU).
ModelWeights RandomRankWeights(const ShardingPlan& plan, const Model& model) {
  ModelWeights w;
  w.layers.resize(model.weights.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) w.layers[l].kind = model.weights.layers[l].kind;
  for (const TensorSlicing& t : plan.tensors) {
    Tensor part = WeightSlot(model.weights, t.spec);
    part.data = nullptr;
    part.shape = t.RankShape(plan.tp);
    WeightSlot(w, t.spec) = part;
  }
  return w;
}

// Rank r of `plan` on `device`: its slices, the Model its engine reads them
// through, and the engine, summing through `all_reduce` (null: alone).
absl::StatusOr<TensorParallelCudaEngine::LoneRank> CreateRank(const Model* model,
                                                              const ShardingPlan& plan, int r,
                                                              int device,
                                                              DeviceAllReduce* all_reduce,
                                                              const CudaEngineOptions& options) {
  TensorParallelCudaEngine::LoneRank out;
  auto rank_model = std::make_unique<Model>();
  rank_model->id = plan.tp > 1 ? absl::StrCat(model->id, " (tp rank ", r, ")") : model->id;
  rank_model->config = plan.rank_config;
  rank_model->fingerprint = model->fingerprint;
  rank_model->storage = model->storage;
  // A rank's contiguous slices are views into these files: its upload preads them.
  rank_model->files = model->files;
  rank_model->weights_on_device_random = model->weights_on_device_random;
  // Every rank draws its own slices: seeded per rank so that ranks do not
  // hold copies of one another's values.
  rank_model->device_random_seed = model->device_random_seed + static_cast<uint64_t>(r);
  std::vector<WeightSpec> specs;
  if (model->weights_on_device_random) {
    rank_model->weights = RandomRankWeights(plan, *model);
    for (const TensorSlicing& t : plan.tensors) {
      WeightSpec s = t.spec;
      s.shape = t.RankShape(plan.tp);
      specs.push_back(std::move(s));
    }
  } else {
    absl::StatusOr<RankWeights> w = SliceForRank(plan, *model, r);
    if (!w.ok()) {
      return absl::Status(w.status().code(),
                          absl::StrCat("model ", model->id, ": ", w.status().message()));
    }
    rank_model->weights = w->weights;
    specs = w->specs;
    out.slices = *std::move(w);
  }
  // Target outputs, in their simple form: the capture rank computes them with
  // the whole lm_head (uploaded there on the first batch that asks), the
  // vocabulary not yet cut across the ranks; the others only run the full
  // forward, so that every layer's all-reduce pairs up. A tied head is the
  // rank's embedding, which every rank holds whole.
  if (r == plan.capture_rank) rank_model->weights.lm_head = model->weights.lm_head;
  CudaEngineOptions o = options;
  o.device = device;
  o.rank.rank = r;
  o.rank.all_reduce = all_reduce;
  o.rank.capture = r == plan.capture_rank;
  o.rank.specs = std::move(specs);
  if (plan.ExpertParallel()) {
    o.rank.expert_begin = plan.ExpertBegin(r);
    o.rank.num_local_experts = plan.experts_per_rank;
  }
  absl::StatusOr<std::unique_ptr<CudaEngine>> e = CudaEngine::Create(rank_model.get(), o);
  if (!e.ok()) {
    return absl::Status(e.status().code(), absl::StrCat("tp rank ", r, " on cuda:", o.device, ": ",
                                                        e.status().message()));
  }
  out.engine = *std::move(e);
  out.model = std::move(rank_model);
  return out;
}

}  // namespace

struct TensorParallelCudaEngine::Impl {
  const Model* model = nullptr;
  // What the engine reports as its model: the model itself, except for a
  // real-size random model, whose ranks draw their slices from seeds of
  // their own: its states are not the unsharded model's, so its
  // fingerprint says so (a feed must not mix the two as one model).
  std::unique_ptr<Model> reported;
  ShardingPlan plan;
  std::vector<int> devices;
  std::unique_ptr<DeviceAllReduce> all_reduce;
  // Per rank: its slices (gathered parts owned here), the Model its engine
  // reads them through, and the engine. Destroyed engines first.
  std::vector<RankWeights> slices;
  std::vector<std::unique_ptr<Model>> rank_models;
  std::vector<std::unique_ptr<CudaEngine>> engines;

  CudaEngine& capturer() { return *engines[static_cast<size_t>(plan.capture_rank)]; }

  // Runs `capture_rank_work` on the capture rank and the forward alone on
  // every other rank, each on its own thread, and returns the first error
  // (the capture rank's first). The input is validated before any rank
  // starts: a rank that refused it while the others waited in an all-reduce
  // would hang the group.
  template <typename Fn>
  absl::Status RunAll(const ForwardInput& in, Fn&& capture_rank_work) {
    DF_RETURN_IF_ERROR(
        ValidateForwardInput(model->config, in, std::numeric_limits<int64_t>::max()));
    const int tp = plan.tp;
    std::vector<absl::Status> status(static_cast<size_t>(tp));
    std::vector<std::thread> threads;
    threads.reserve(static_cast<size_t>(tp));
    for (int r = 0; r < tp; ++r) {
      if (r == plan.capture_rank) continue;
      threads.emplace_back([&, r] {
        status[static_cast<size_t>(r)] = engines[static_cast<size_t>(r)]->ForwardOnDevice(in);
      });
    }
    status[static_cast<size_t>(plan.capture_rank)] = capture_rank_work();
    for (std::thread& t : threads) t.join();
    if (!status[static_cast<size_t>(plan.capture_rank)].ok()) {
      return status[static_cast<size_t>(plan.capture_rank)];
    }
    for (int r = 0; r < tp; ++r) {
      if (!status[static_cast<size_t>(r)].ok()) {
        return absl::Status(
            status[static_cast<size_t>(r)].code(),
            absl::StrCat("tp rank ", r, ": ", status[static_cast<size_t>(r)].message()));
      }
    }
    return absl::OkStatus();
  }
};

TensorParallelCudaEngine::TensorParallelCudaEngine(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
TensorParallelCudaEngine::~TensorParallelCudaEngine() {
  // The engines (their copy threads, their device memory) go before the
  // communicators and the host slices they read.
  if (impl_) impl_->engines.clear();
}

absl::StatusOr<std::unique_ptr<TensorParallelCudaEngine>> TensorParallelCudaEngine::Create(
    const Model* model, ShardingPlan plan, const std::vector<int>& devices,
    const CudaEngineOptions& options) {
  if (model == nullptr) {
    return absl::InvalidArgumentError("TensorParallelCudaEngine::Create: model is null");
  }
  if (static_cast<int>(devices.size()) != plan.tp) {
    return absl::InvalidArgumentError(absl::StrCat("--tp ", plan.tp, " needs ", plan.tp,
                                                   " devices per group; got ", devices.size()));
  }
  // FP8 weights (a checkpoint's, or a random:*-fp8 model's made on the GPU)
  // must cut on their scale blocks; refused before any rank loads.
  DF_RETURN_IF_ERROR(CheckBlockScaleCuts(plan, *model));
  auto impl = std::make_unique<Impl>();
  impl->model = model;
  impl->devices = devices;
  DF_ASSIGN_OR_RETURN(impl->all_reduce, MakeDeviceAllReduce(devices));
  for (int r = 0; r < plan.tp; ++r) {
    DF_ASSIGN_OR_RETURN(LoneRank rank, CreateRank(model, plan, r, devices[static_cast<size_t>(r)],
                                                  impl->all_reduce.get(), options));
    impl->slices.push_back(std::move(rank.slices));
    impl->rank_models.push_back(std::move(rank.model));
    impl->engines.push_back(std::move(rank.engine));
  }
  if (model->weights_on_device_random && plan.tp > 1) {
    impl->reported = std::make_unique<Model>(*model);
    impl->reported->fingerprint =
        absl::StrCat(model->fingerprint, "+tp", plan.tp, plan.ExpertParallel() ? "-ep" : "");
  }
  impl->plan = std::move(plan);
  return std::unique_ptr<TensorParallelCudaEngine>(new TensorParallelCudaEngine(std::move(impl)));
}

absl::StatusOr<TensorParallelCudaEngine::LoneRank> TensorParallelCudaEngine::CreateLoneRank(
    const Model* model, const ShardingPlan& plan, int rank, int device,
    const CudaEngineOptions& options) {
  if (model == nullptr || rank < 0 || rank >= plan.tp) {
    return absl::InvalidArgumentError("CreateLoneRank: no model, or a rank outside the plan");
  }
  return CreateRank(model, plan, rank, device, nullptr, options);
}

const Model& TensorParallelCudaEngine::model() const {
  return impl_->reported ? *impl_->reported : *impl_->model;
}
const ShardingPlan& TensorParallelCudaEngine::plan() const { return impl_->plan; }
const CudaEngine& TensorParallelCudaEngine::rank(int r) const {
  return *impl_->engines[static_cast<size_t>(r)];
}
std::string TensorParallelCudaEngine::all_reduce_kind() const {
  return impl_->all_reduce ? impl_->all_reduce->kind() : "none";
}

std::string TensorParallelCudaEngine::device_name() const {
  return absl::StrCat("cuda:", absl::StrJoin(impl_->devices, ","), " tp", impl_->plan.tp);
}

Engine::ParallelLayout TensorParallelCudaEngine::layout() const {
  ParallelLayout l;
  l.tp = impl_->plan.tp;
  l.moe_parallel = impl_->plan.MoeLayoutName();
  int64_t most = 0;
  for (const auto& e : impl_->engines) most = std::max(most, e->weight_bytes());
  l.rank_weight_bytes = most;
  return l;
}

std::vector<CaptureEncoding> TensorParallelCudaEngine::encodings() const {
  return rank(impl_->plan.capture_rank).encodings();
}

int64_t TensorParallelCudaEngine::max_capture_layers() const {
  return rank(impl_->plan.capture_rank).max_capture_layers();
}

bool TensorParallelCudaEngine::serves_target_outputs() const {
  return rank(impl_->plan.capture_rank).serves_target_outputs();
}

int64_t TensorParallelCudaEngine::max_carry_tokens() const {
  int64_t tokens = impl_->engines.front()->max_carry_tokens();
  for (const auto& e : impl_->engines) tokens = std::min(tokens, e->max_carry_tokens());
  return tokens;
}

int64_t TensorParallelCudaEngine::CarryBytes(int64_t tokens) const {
  int64_t bytes = 0;
  for (const auto& e : impl_->engines) bytes += e->CarryBytes(tokens);
  return bytes;
}

absl::Status TensorParallelCudaEngine::ReserveCarry(int64_t tokens) {
  for (size_t r = 0; r < impl_->engines.size(); ++r) {
    if (absl::Status s = impl_->engines[r]->ReserveCarry(tokens); !s.ok()) {
      for (const auto& e : impl_->engines) (void)e->ReserveCarry(0);  // all or none
      return absl::Status(s.code(), absl::StrCat("tp rank ", r, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

void TensorParallelCudaEngine::DropCarry() {
  for (const auto& e : impl_->engines) e->DropCarry();
}

absl::Status TensorParallelCudaEngine::Forward(const ForwardInput& in, std::span<std::byte> out) {
  return impl_->RunAll(in, [&] { return impl_->capturer().Forward(in, out); });
}

absl::Status TensorParallelCudaEngine::ForwardOnDevice(const ForwardInput& in) {
  return impl_->RunAll(in, [&] { return impl_->capturer().ForwardOnDevice(in); });
}

absl::Status TensorParallelCudaEngine::ForwardAsync(const ForwardInput& in,
                                                    std::span<std::byte> out,
                                                    CopiedCallback on_copied) {
  return impl_->RunAll(
      in, [&] { return impl_->capturer().ForwardAsync(in, out, std::move(on_copied)); });
}

absl::Status TensorParallelCudaEngine::ForwardToDevice(const ForwardInput& in,
                                                       const DeviceSink& sink,
                                                       CopiedCallback on_sent) {
  return impl_->RunAll(
      in, [&] { return impl_->capturer().ForwardToDevice(in, sink, std::move(on_sent)); });
}

}  // namespace draftfeed
