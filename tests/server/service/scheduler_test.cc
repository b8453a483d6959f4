// The scheduler's completion path: deliveries leave each engine in the order
// its forwards ran, whatever order the copies finish in; a slow `done` does
// not hold up the next forward (up to the undelivered bound); every item gets
// exactly one `done`; every capture buffer returns to the pool.
#include "server/service/scheduler.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "common/payload_checksum.h"
#include "server/model/model.h"

namespace draftfeed {
namespace {

using std::chrono::milliseconds;

// An engine whose copies finish on their own threads after a delay that
// shrinks from batch to batch, so later copies overtake earlier ones. Every
// value of a batch's capture is its first token id. Token id 4000 fails the
// forward; 4001 fails the copy.
class OvertakingEngine final : public Engine {
 public:
  OvertakingEngine() : model_(*OpenModel("tiny-random")) {}
  ~OvertakingEngine() override {
    for (std::thread& t : copies_) t.join();
  }
  const Model& model() const override { return *model_; }
  std::string device_name() const override { return "fake"; }
  absl::Status Forward(const ForwardInput& in, std::span<std::byte> out) override {
    Fill(out, static_cast<uint16_t>(in.token_ids[0]));
    return absl::OkStatus();
  }
  absl::Status ForwardAsync(const ForwardInput& in, std::span<std::byte> out,
                            CopiedCallback on_copied) override {
    ++forwards_;
    if (in.token_ids[0] == 4000) return absl::InvalidArgumentError("bad batch");
    const auto delay = milliseconds(std::max(0, 60 - 20 * (forwards_ % 4)));
    const bool fail = in.token_ids[0] == 4001;
    const uint16_t value = static_cast<uint16_t>(in.token_ids[0]);
    copies_.emplace_back([=] {
      std::this_thread::sleep_for(delay);
      Fill(out, value);
      on_copied({fail ? absl::InternalError("copy failed") : absl::OkStatus(), std::nullopt});
    });
    return absl::OkStatus();
  }
  // The capture stays "on the device" (a buffer of the engine's) and the
  // sink's work is waited for on a thread of its own, after the same
  // shrinking delay, so later sends overtake earlier ones too.
  absl::Status ForwardToDevice(const ForwardInput& in, const DeviceSink& sink,
                               CopiedCallback on_sent) override {
    ++forwards_;
    if (in.token_ids[0] == 4000) return absl::InvalidArgumentError("bad batch");
    auto capture = std::make_shared<std::vector<uint16_t>>(
        in.token_ids.size() * in.layers.size() * model_->config.hidden_size,
        static_cast<uint16_t>(in.token_ids[0]));
    DeviceView view;
    view.data = capture->data();
    view.bytes = capture->size() * 2;
    view.bytes_per_token = static_cast<int64_t>(in.layers.size()) * model_->config.hidden_size * 2;
    absl::StatusOr<DeviceWait> wait = sink(view);
    if (!wait.ok()) return wait.status();
    const auto delay = milliseconds(std::max(0, 60 - 20 * (forwards_ % 4)));
    copies_.emplace_back([=, wait = *std::move(wait)] {
      std::this_thread::sleep_for(delay);
      Copied sent = wait();
      (void)capture;  // kept until the sink's work is done
      on_sent(std::move(sent));
    });
    return absl::OkStatus();
  }
  int forwards() const { return forwards_.load(); }

 private:
  // Every bf16 value of the capture set to `value`.
  static void Fill(std::span<std::byte> out, uint16_t value) {
    for (size_t i = 0; i + 1 < out.size(); i += 2) std::memcpy(&out[i], &value, 2);
  }
  std::unique_ptr<Model> model_;
  std::atomic<int> forwards_{0};
  std::vector<std::thread> copies_;  // only the worker thread appends
};

struct Delivery {
  int32_t id = 0;
  absl::StatusCode code = absl::StatusCode::kOk;
  bool values_ok = false;
};

class Recorder {
 public:
  WorkItem Item(int32_t id, int32_t tokens = 64) {
    WorkItem item;
    item.token_ids.assign(static_cast<size_t>(tokens), id);
    item.seq_lens = {tokens};
    item.layers = {0, -1};
    item.done = [this, id, tokens](absl::StatusOr<ForwardResult> r) {
      Delivery d{id, r.status().code(), false};
      if (r.ok()) {
        d.values_ok = r->bytes > 0 && r->encoding == CaptureEncoding::kBf16 &&
                      r->bytes == static_cast<size_t>(tokens * r->bytes_per_token);
        const auto* values = reinterpret_cast<const uint16_t*>(r->capture.get());
        for (size_t i = 0; i < r->bytes / 2; ++i) d.values_ok &= values[i] == id;
      }
      std::lock_guard<std::mutex> lock(mu_);
      got_.push_back(d);
      cv_.notify_all();
    };
    return item;
  }
  std::vector<Delivery> WaitFor(size_t n, milliseconds timeout = milliseconds(10000)) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, timeout, [&] { return got_.size() >= n; });
    return got_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Delivery> got_;
};

TEST(SchedulerTest, DeliversInForwardOrderWhenCopiesFinishOutOfOrder) {
  OvertakingEngine engine;
  Scheduler sched({&engine}, 64);
  Recorder rec;
  constexpr int kItems = 12;
  for (int i = 0; i < kItems; ++i) ASSERT_TRUE(sched.Submit(rec.Item(100 + i)).ok());
  const std::vector<Delivery> got = rec.WaitFor(kItems);
  ASSERT_EQ(got.size(), kItems);
  for (int i = 0; i < kItems; ++i) {
    EXPECT_EQ(got[i].id, 100 + i);
    EXPECT_EQ(got[i].code, absl::StatusCode::kOk);
    EXPECT_TRUE(got[i].values_ok) << "batch " << i << " delivered before its copy finished";
  }
  sched.Stop();
  EXPECT_EQ(sched.completed_batches(), kItems);
  EXPECT_EQ(sched.running(), 0);
  EXPECT_EQ(sched.pool().live_bytes(), 0);  // the recorder kept no buffer
}

TEST(SchedulerTest, SlowDeliveryDoesNotHoldUpTheNextForward) {
  OvertakingEngine engine;
  Scheduler sched({&engine}, 64);
  Recorder rec;
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  WorkItem first = rec.Item(7);
  first.done = [&, inner = std::move(first.done)](absl::StatusOr<ForwardResult> r) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return release; });  // a checksum that takes forever
    inner(std::move(r));
  };
  ASSERT_TRUE(sched.Submit(std::move(first)).ok());
  for (int i = 1; i < 8; ++i) ASSERT_TRUE(sched.Submit(rec.Item(7 + i)).ok());
  // While batch 0 is being delivered the worker runs on, up to the bound.
  const int bound = 1 + static_cast<int>(Scheduler::kMaxUndelivered);
  for (int i = 0; i < 500 && engine.forwards() < bound; ++i) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  std::this_thread::sleep_for(milliseconds(200));
  EXPECT_EQ(engine.forwards(), bound) << "the worker waited for delivery, or ran past its bound";
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  const std::vector<Delivery> got = rec.WaitFor(8);
  ASSERT_EQ(got.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(got[i].id, 7 + i);
}

TEST(SchedulerTest, EveryItemGetsExactlyOneDone) {
  OvertakingEngine engine;
  Recorder rec;
  std::vector<Delivery> got;
  {
    Scheduler sched({&engine}, 64);
    const std::vector<int32_t> ids = {1, 4000, 2, 4001, 3, 5, 4000, 6};
    for (int32_t id : ids) {
      WorkItem item = rec.Item(id);
      if (id == 5) item.cancelled = [] { return true; };
      ASSERT_TRUE(sched.Submit(std::move(item)).ok());
    }
    sched.Stop();  // delivers everything accepted before returning
    got = rec.WaitFor(ids.size());
    ASSERT_EQ(got.size(), ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT_EQ(got[i].id, ids[i]);
      const absl::StatusCode want = ids[i] == 4000   ? absl::StatusCode::kInvalidArgument
                                    : ids[i] == 4001 ? absl::StatusCode::kInternal
                                    : ids[i] == 5    ? absl::StatusCode::kCancelled
                                                     : absl::StatusCode::kOk;
      EXPECT_EQ(got[i].code, want) << "item " << i;
    }
    EXPECT_EQ(sched.pool().live_bytes(), 0);
    EXPECT_EQ(sched.completed_batches(), static_cast<int64_t>(ids.size()));
    EXPECT_FALSE(sched.Submit(rec.Item(9)).ok());
  }
  EXPECT_EQ(rec.WaitFor(9, milliseconds(200)).size(), got.size());  // no late or second call
}

// A trainer's packed batches differ by a few tokens, and the pool keeps less
// idle memory than two of them: capture buffers still come back for reuse
// (size classes, and an idle cap raised to two buffers), so a stream of
// such batches allocates a couple of buffers, not one per batch, and every
// value is still the batch's own.
TEST(SchedulerTest, BatchesOfVaryingSizeReuseTheirCaptureBuffers) {
  OvertakingEngine engine;
  Scheduler sched({&engine}, 64, 0, /*pool_idle_bytes=*/1);
  Recorder rec;
  constexpr int kItems = 24;
  std::vector<Delivery> got;
  for (int i = 0; i < kItems; ++i) {
    // 900..1019 tokens; submitted one at a time, as a trainer at its credit
    // limit would see them run.
    ASSERT_TRUE(sched.Submit(rec.Item(200 + i, 900 + (i * 37) % 120)).ok());
    got = rec.WaitFor(static_cast<size_t>(i + 1));
  }
  ASSERT_EQ(got.size(), static_cast<size_t>(kItems));
  for (const Delivery& d : got) {
    EXPECT_EQ(d.code, absl::StatusCode::kOk);
    EXPECT_TRUE(d.values_ok) << "batch " << d.id;
  }
  EXPECT_LE(sched.pool().allocations(), 2) << "capture buffers were allocated per batch";
  sched.Stop();
}

// Device sinks (the NCCL transport): results leave in forward order with the
// checksum the sink's wait reported and no host buffer; a sink that refuses,
// a wait that fails and a forward that fails each reach their item's done.
TEST(SchedulerTest, DeviceSinksDeliverInForwardOrderWithTheirChecksums) {
  OvertakingEngine engine;
  struct Got {
    int32_t id;
    absl::StatusCode code;
    std::optional<uint64_t> checksum;
    bool host_buffer;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Got> got;
  const std::vector<int32_t> ids = {10, 11, 4002, 12, 4003, 4000, 13, 14, 15};
  const int32_t tokens = 64;
  {
    Scheduler sched({&engine}, 64);
    for (int32_t id : ids) {
      WorkItem item;
      item.token_ids.assign(tokens, id);
      item.seq_lens = {tokens};
      item.layers = {0, -1};
      item.device_sink = [id](const Engine::DeviceView& v) -> absl::StatusOr<Engine::DeviceWait> {
        if (id == 4002) return absl::UnavailableError("sink refused");
        const uint64_t sum = v1::PayloadChecksum(v.data, v.bytes);
        return Engine::DeviceWait([id, sum] {
          return id == 4003 ? Engine::Copied{absl::InternalError("send failed"), std::nullopt}
                            : Engine::Copied{absl::OkStatus(), sum};
        });
      };
      item.done = [&, id](absl::StatusOr<ForwardResult> r) {
        std::lock_guard<std::mutex> lock(mu);
        got.push_back({id, r.status().code(), r.ok() ? r->checksum : std::nullopt,
                       r.ok() && r->capture != nullptr});
        cv.notify_all();
      };
      ASSERT_TRUE(sched.Submit(std::move(item)).ok());
    }
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(
        cv.wait_for(lock, std::chrono::seconds(10), [&] { return got.size() == ids.size(); }));
  }
  const size_t values = tokens * 2 * engine.model().config.hidden_size;
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(got[i].id, ids[i]) << "item " << i;
    const absl::StatusCode want = ids[i] == 4000   ? absl::StatusCode::kInvalidArgument
                                  : ids[i] == 4002 ? absl::StatusCode::kUnavailable
                                  : ids[i] == 4003 ? absl::StatusCode::kInternal
                                                   : absl::StatusCode::kOk;
    EXPECT_EQ(got[i].code, want) << "item " << i;
    if (want != absl::StatusCode::kOk) continue;
    const std::vector<uint16_t> payload(values, static_cast<uint16_t>(ids[i]));
    EXPECT_EQ(got[i].checksum, v1::PayloadChecksum(payload.data(), payload.size() * 2));
    EXPECT_FALSE(got[i].host_buffer);
  }
}

// An engine whose forwards record their first token id and wait while the
// gate is shut: batches from several streams queue up before any runs, and
// the order the scheduler chose is read back afterwards.
class GateEngine final : public Engine {
 public:
  GateEngine() : model_(*OpenModel("tiny-random")) {}
  const Model& model() const override { return *model_; }
  std::string device_name() const override { return "gate"; }
  absl::Status Forward(const ForwardInput& in, std::span<std::byte> out) override {
    std::unique_lock<std::mutex> lock(mu_);
    order_.push_back(in.token_ids[0]);
    cv_.notify_all();
    cv_.wait(lock, [this] { return open_; });
    const uint16_t value = static_cast<uint16_t>(in.token_ids[0]);
    for (size_t i = 0; i + 1 < out.size(); i += 2) std::memcpy(&out[i], &value, 2);
    return absl::OkStatus();
  }
  void Set(bool open) {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = open;
    cv_.notify_all();
  }
  bool WaitForForwards(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10), [&] { return order_.size() >= n; });
  }
  std::vector<int32_t> order() const {
    std::lock_guard<std::mutex> lock(mu_);
    return order_;
  }

 private:
  std::unique_ptr<Model> model_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
  std::vector<int32_t> order_;
};

WorkItem ForStream(Recorder& rec, uint64_t stream, int32_t id, int32_t tokens,
                   int64_t result_bytes = 0) {
  WorkItem item = rec.Item(id, tokens);
  item.stream = stream;
  item.result_bytes = result_bytes;
  return item;
}

// Stream a queues 32 batches while the engine is held on a batch of the
// default stream; then b queues 4. First come, first served would run all of
// a's first. Fair queueing alternates the two (equal batch sizes), so b's
// n-th batch (from 0) runs at position 2n + 1 at the latest; each stream's
// batches keep their order.
TEST(SchedulerTest, FairQueueingDoesNotLetAQueuedStreamPushAnotherBack) {
  GateEngine engine;
  Recorder rec;
  Scheduler sched({&engine}, 256);
  const uint64_t a = sched.AddStream(0), b = sched.AddStream(0);
  engine.Set(false);
  ASSERT_TRUE(sched.Submit(rec.Item(1)).ok());
  ASSERT_TRUE(engine.WaitForForwards(1));
  for (int i = 0; i < 32; ++i) ASSERT_TRUE(sched.Submit(ForStream(rec, a, 100 + i, 64)).ok());
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(sched.Submit(ForStream(rec, b, 200 + i, 64)).ok());
  EXPECT_EQ(sched.queued(), 36);
  engine.Set(true);
  ASSERT_EQ(rec.WaitFor(37).size(), 37u);
  const std::vector<int32_t> order = engine.order();
  std::vector<int32_t> of_a, of_b;
  std::vector<size_t> b_at;
  for (size_t i = 1; i < order.size(); ++i) {
    if (order[i] >= 200) {
      of_b.push_back(order[i]);
      b_at.push_back(i - 1);
    } else {
      of_a.push_back(order[i]);
    }
  }
  ASSERT_EQ(of_a.size(), 32u);
  ASSERT_EQ(of_b.size(), 4u);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(of_a[i], 100 + i);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(of_b[i], 200 + i);
    EXPECT_LE(b_at[i], static_cast<size_t>(2 * i + 1)) << "b's batch " << i;
  }
}

// Fairness is by tokens: beside a stream of 256-token batches, one of
// 64-token batches gets four batches per batch of the other, and while both
// have batches queued the tokens taken for them never differ by more than
// one batch.
TEST(SchedulerTest, FairQueueingSharesTokensNotBatches) {
  GateEngine engine;
  Recorder rec;
  Scheduler sched({&engine}, 256);
  const uint64_t big = sched.AddStream(0), small = sched.AddStream(0);
  engine.Set(false);
  ASSERT_TRUE(sched.Submit(rec.Item(1)).ok());
  ASSERT_TRUE(engine.WaitForForwards(1));
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(sched.Submit(ForStream(rec, big, 1000 + i, 256)).ok());
  for (int i = 0; i < 40; ++i) ASSERT_TRUE(sched.Submit(ForStream(rec, small, 2000 + i, 64)).ok());
  engine.Set(true);
  ASSERT_EQ(rec.WaitFor(51).size(), 51u);
  const std::vector<int32_t> order = engine.order();
  int64_t big_tokens = 0, small_tokens = 0;
  int big_n = 0, small_n = 0;
  for (size_t i = 1; i < order.size(); ++i) {
    if (order[i] >= 2000) {
      EXPECT_EQ(order[i], 2000 + small_n++);
      small_tokens += 64;
    } else {
      EXPECT_EQ(order[i], 1000 + big_n++);
      big_tokens += 256;
    }
    if (big_n < 10 && small_n < 40) {
      EXPECT_LE(std::abs(big_tokens - small_tokens), 256) << "after " << i << " batches";
    }
  }
  EXPECT_EQ(big_n, 10);
  EXPECT_EQ(small_n, 40);
}

// A stream at its pending cap is skipped while others run; each release
// lets exactly as much more of it run as fits under the cap again; removing
// it drains what it queued.
TEST(SchedulerTest, APendingCapHoldsBackOnlyItsStream) {
  GateEngine engine;
  Recorder rec;
  Scheduler sched({&engine}, 256);
  const uint64_t capped = sched.AddStream(/*max_pending_bytes=*/200);
  const uint64_t free = sched.AddStream(0);
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(sched.Submit(ForStream(rec, capped, 300 + i, 64, /*result_bytes=*/100)).ok());
  }
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(sched.Submit(ForStream(rec, free, 400 + i, 64)).ok());
  // Two of the capped stream's batches reach its cap; the other stream's
  // six all run.
  ASSERT_EQ(rec.WaitFor(8).size(), 8u);
  EXPECT_EQ(rec.WaitFor(9, milliseconds(300)).size(), 8u) << "a capped stream ran past its cap";
  EXPECT_EQ(sched.pending_bytes(capped), 200);
  EXPECT_EQ(sched.queued(), 4);
  sched.ReleasePending(capped, 100);  // one result written: one more fits
  ASSERT_EQ(rec.WaitFor(9).size(), 9u);
  EXPECT_EQ(rec.WaitFor(10, milliseconds(300)).size(), 9u);
  EXPECT_EQ(sched.pending_bytes(capped), 200);
  // A charge (an unsent error) counts as a result would.
  sched.ChargePending(capped, 150);
  sched.ReleasePending(capped, 200);
  ASSERT_EQ(rec.WaitFor(10).size(), 10u);
  EXPECT_EQ(rec.WaitFor(11, milliseconds(300)).size(), 10u);
  EXPECT_EQ(sched.pending_bytes(capped), 250);
  sched.RemoveStream(capped);  // the stream went away: its last two still get their done
  const std::vector<Delivery> got = rec.WaitFor(12);
  ASSERT_EQ(got.size(), 12u);
  std::vector<int32_t> capped_order;
  for (const Delivery& d : got) {
    if (d.id < 400) capped_order.push_back(d.id);
  }
  EXPECT_EQ(capped_order, (std::vector<int32_t>{300, 301, 302, 303, 304, 305}));
  EXPECT_EQ(sched.Submit(ForStream(rec, capped, 399, 64)).code(), absl::StatusCode::kNotFound);
  sched.ReleasePending(capped, 100);  // a removed stream: a no-op
  EXPECT_EQ(sched.pending_bytes(capped), 0);
}

// A batch larger than the cap does not stop the stream's pipeline: two of
// its batches are always let in flight (one written while the next
// computes), never a third. Before, a 49,152-token bf16 capture (2.4 GB at
// the 27B shape) under the default 2 GiB cap ran one batch at a time.
TEST(SchedulerTest, TwoBatchesLargerThanTheCapStillOverlap) {
  GateEngine engine;
  Recorder rec;
  Scheduler sched({&engine}, 256);
  const uint64_t s = sched.AddStream(/*max_pending_bytes=*/100);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(sched.Submit(ForStream(rec, s, 500 + i, 64, /*result_bytes=*/300)).ok());
  }
  ASSERT_EQ(rec.WaitFor(2).size(), 2u);
  EXPECT_EQ(rec.WaitFor(3, milliseconds(300)).size(), 2u) << "a third batch ran past the cap";
  EXPECT_EQ(sched.pending_bytes(s), 600);
  sched.ReleasePending(s, 300);  // the first written: the third may compute
  ASSERT_EQ(rec.WaitFor(3).size(), 3u);
  EXPECT_EQ(rec.WaitFor(4, milliseconds(300)).size(), 3u);
  sched.RemoveStream(s);
  EXPECT_EQ(rec.WaitFor(4).size(), 4u);
}

}  // namespace
}  // namespace draftfeed
