#include "server/model/sharded_cpu_engine.h"

#include <algorithm>
#include <barrier>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/model/cpu_forward.h"

namespace draftfeed {
namespace {

// The all-reduce of threads as ranks: every rank posts its buffer; rank q
// then sums elements [q*n/tp, (q+1)*n/tp) of all buffers, always as
// ((b0 + b1) + b2) + ..., and writes the sum into every buffer. Each element
// is read and written by one rank only, so the sum needs no lock; the two
// barriers order the posting before the sums and the sums before any rank
// reads its buffer (or posts the next one). Fixed order, so a batch's result
// is the same on every run whatever the thread timing.
class InProcessAllReduce {
 public:
  explicit InProcessAllReduce(int ranks)
      : ranks_(ranks), barrier_(ranks), buffers_(static_cast<size_t>(ranks)) {}

  void Run(int rank, CpuForward::Buffer& m) {
    buffers_[static_cast<size_t>(rank)] = &m;
    barrier_.arrive_and_wait();
    const int64_t n = static_cast<int64_t>(m.size());
    const int64_t begin = n * rank / ranks_, end = n * (rank + 1) / ranks_;
    for (int64_t i = begin; i < end; ++i) {
      float sum = (*buffers_[0])[static_cast<size_t>(i)];
      for (int q = 1; q < ranks_; ++q)
        sum += (*buffers_[static_cast<size_t>(q)])[static_cast<size_t>(i)];
      for (int q = 0; q < ranks_; ++q)
        (*buffers_[static_cast<size_t>(q)])[static_cast<size_t>(i)] = sum;
    }
    barrier_.arrive_and_wait();
  }

 private:
  const int ranks_;
  std::barrier<> barrier_;
  std::vector<CpuForward::Buffer*> buffers_;
};

}  // namespace

struct ShardedCpuEngine::Impl {
  const Model* model = nullptr;
  ShardingPlan plan;
  std::vector<RankWeights> weights;  // per rank; the forwards read their embeddings in place
  std::vector<CpuForward> ranks;
  std::unique_ptr<CpuTargetOutputs> outputs;
  int64_t rank_weight_bytes = 0;
  // One per rank; all alike in tokens (the ranks run every forward together).
  mutable std::vector<CpuSequenceCarry> carries;

  absl::StatusOr<int64_t> CheckInput(const ForwardInput& in) const {
    DF_ASSIGN_OR_RETURN(const int64_t n, CpuForward::CaptureElements(model->config, in));
    DF_RETURN_IF_ERROR(
        CheckCarriedInput(in, carries[0].tokens, carries[0].max_tokens, "the CPU engine"));
    return n;
  }

  // Every rank's forward on its own thread (rank 0 on the caller's); the
  // capture is rank 0's.
  void Run(const ForwardInput& in, float* out, float* final_states = nullptr) const {
    const int tp = plan.tp;
    InProcessAllReduce reduce(tp);
    auto forward = [&](int r) {
      const bool capture = r == plan.capture_rank;
      ranks[static_cast<size_t>(r)].Run(in, capture ? out : nullptr,
                                        [&reduce, r](CpuForward::Buffer& m) { reduce.Run(r, m); },
                                        capture ? final_states : nullptr,
                                        &carries[static_cast<size_t>(r)]);
    };
    std::vector<std::thread> threads;
    threads.reserve(static_cast<size_t>(tp - 1));
    for (int r = 1; r < tp; ++r) threads.emplace_back(forward, r);
    forward(0);
    for (std::thread& t : threads) t.join();
  }
};

ShardedCpuEngine::ShardedCpuEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ShardedCpuEngine::~ShardedCpuEngine() = default;

absl::StatusOr<std::unique_ptr<ShardedCpuEngine>> ShardedCpuEngine::Create(const Model* model,
                                                                           ShardingPlan plan,
                                                                           int num_threads) {
  if (model == nullptr)
    return absl::InvalidArgumentError("ShardedCpuEngine::Create: model is null");
  if (model->weights_on_device_random) {
    return absl::FailedPreconditionError(
        absl::StrCat("model ", model->id,
                     " is a real-size random model whose weights are made on the GPU; it needs "
                     "the CUDA engine (--device cuda:N)"));
  }
  if (num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_threads is ", num_threads, "; use 0 for one per core, or a count"));
  }
  const int total = num_threads > 0
                        ? num_threads
                        : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int per_rank = std::max(1, total / plan.tp);
  auto impl = std::make_unique<Impl>();
  impl->model = model;
  impl->rank_weight_bytes = RankWeightBytes(plan, *model);
  for (int r = 0; r < plan.tp; ++r) {
    absl::StatusOr<RankWeights> w = SliceForRank(plan, *model, r);
    if (!w.ok()) {
      return absl::Status(w.status().code(),
                          absl::StrCat("model ", model->id, ": ", w.status().message()));
    }
    impl->weights.push_back(*std::move(w));
  }
  for (int r = 0; r < plan.tp; ++r) {
    const RankWeights& w = impl->weights[static_cast<size_t>(r)];
    CpuForward::Rank rank;
    rank.config = plan.rank_config;
    rank.weights = &w.weights;
    rank.expert_begin = plan.ExpertBegin(r);
    rank.num_local_experts = plan.experts_per_rank;
    absl::StatusOr<CpuForward> f = CpuForward::Create(rank, w.specs, per_rank);
    if (!f.ok()) {
      return absl::Status(f.status().code(), absl::StrCat("model ", model->id, ", tp rank ", r,
                                                          ": ", f.status().message()));
    }
    impl->ranks.push_back(*std::move(f));
  }
  impl->carries.resize(impl->ranks.size());
  impl->plan = std::move(plan);
  impl->outputs = std::make_unique<CpuTargetOutputs>(model, num_threads);
  return std::unique_ptr<ShardedCpuEngine>(new ShardedCpuEngine(std::move(impl)));
}

const Model& ShardedCpuEngine::model() const { return *impl_->model; }

const ShardingPlan& ShardedCpuEngine::plan() const { return impl_->plan; }

std::string ShardedCpuEngine::device_name() const { return absl::StrCat("cpu tp", impl_->plan.tp); }

Engine::ParallelLayout ShardedCpuEngine::layout() const {
  ParallelLayout l;
  l.tp = impl_->plan.tp;
  l.moe_parallel = impl_->plan.MoeLayoutName();
  l.rank_weight_bytes = impl_->rank_weight_bytes;
  return l;
}

absl::Status ShardedCpuEngine::ForwardFloat(const ForwardInput& in, std::span<float> out) {
  DF_ASSIGN_OR_RETURN(const int64_t n, impl_->CheckInput(in));
  DF_RETURN_IF_ERROR(
      CpuForward::CheckFloatOutput(in, impl_->model->config.hidden_size, out.size(), n));
  impl_->Run(in, out.data());
  return absl::OkStatus();
}

absl::Status ShardedCpuEngine::Forward(const ForwardInput& in, std::span<std::byte> out) {
  DF_ASSIGN_OR_RETURN(const int64_t n, impl_->CheckInput(in));
  DF_RETURN_IF_ERROR(CheckCaptureOutput(*this, in, out.size()));
  const Impl& impl = *impl_;
  return CpuForward::ForwardRows(
      in, *impl.model, n,
      [&](float* states, float* final_states) { impl.Run(in, states, final_states); }, *impl.outputs,
      out);
}

bool ShardedCpuEngine::serves_target_outputs() const { return impl_->outputs->served(); }

int64_t ShardedCpuEngine::max_carry_tokens() const { return impl_->carries[0].max_tokens; }

int64_t ShardedCpuEngine::CarryBytes(int64_t tokens) const {
  // The ranks' shares add up to the whole model's (each holds its heads).
  return CpuSequenceCarryBytes(impl_->model->config, tokens);
}

absl::Status ShardedCpuEngine::ReserveCarry(int64_t tokens) {
  if (tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot carry ", tokens, " tokens"));
  }
  for (CpuSequenceCarry& c : impl_->carries) c.max_tokens = tokens;
  return absl::OkStatus();
}

void ShardedCpuEngine::DropCarry() {
  for (CpuSequenceCarry& c : impl_->carries) c.Clear();
}

}  // namespace draftfeed
