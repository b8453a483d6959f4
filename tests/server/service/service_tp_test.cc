// GetTargetInfo.layout: what a target reports of how it holds the model.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "server/model/cpu_engine.h"
#include "server/model/model.h"
#include "server/model/sharded_cpu_engine.h"
#include "server/model/sharding_plan.h"
#include "server/service/target_service.h"

namespace draftfeed {
namespace {

TEST(ServiceTensorParallelTest, TargetInfoReportsTheLayout) {
  absl::StatusOr<std::unique_ptr<Model>> model = MakeRandomModel("tiny-random-moe");
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<ShardingPlan> plan = PlanTensorParallel((*model)->config, 2, MoeParallel::kSplit);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const int64_t rank_bytes = RankWeightBytes(*plan, **model);
  auto sharded = ShardedCpuEngine::Create(model->get(), *std::move(plan), 2);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  {
    TargetService service({sharded->get()}, ServiceOptions{});
    const v1::TargetInfo info = service.Info();
    EXPECT_EQ(info.layout().tp(), 2);
    EXPECT_EQ(info.layout().moe_parallel(), "split");
    EXPECT_EQ(info.layout().rank_weight_bytes(), rank_bytes);
    ASSERT_EQ(info.devices_size(), 1);
    EXPECT_EQ(info.devices(0), "cpu tp2");
  }
  // An unsharded engine holds the whole decoder: tp 1, no MoE strategy.
  auto whole = CpuEngine::Create(model->get(), 1);
  ASSERT_TRUE(whole.ok()) << whole.status();
  TargetService service({whole->get()}, ServiceOptions{});
  const v1::TargetInfo info = service.Info();
  EXPECT_EQ(info.layout().tp(), 1);
  EXPECT_EQ(info.layout().moe_parallel(), "");
  absl::StatusOr<ShardingPlan> one = PlanTensorParallel((*model)->config, 1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(info.layout().rank_weight_bytes(), RankWeightBytes(*one, **model));
  EXPECT_GT(info.layout().rank_weight_bytes(), rank_bytes);
}

}  // namespace
}  // namespace draftfeed
