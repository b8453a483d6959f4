// A TargetService on loopback whose engine records the order its forwards
// run in and can be held shut: how the fairness tests queue batches from
// several streams before any of them runs and then read the order the
// scheduler chose, without depending on timing.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "server/model/cpu_engine.h"
#include "server/service/target_service.h"

namespace draftfeed::testing {

// A CPU engine whose every forward first records the batch's first token id
// (the tests mark each stream's batches by it), then waits while the gate is
// shut.
class GatedEngine final : public Engine {
 public:
  explicit GatedEngine(Engine* inner) : inner_(inner) {}
  const Model& model() const override { return inner_->model(); }
  std::string device_name() const override { return "gated " + inner_->device_name(); }
  absl::Status Forward(const ForwardInput& in, std::span<std::byte> out) override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      order_.push_back(in.token_ids.empty() ? -1 : in.token_ids[0]);
      cv_.notify_all();
      cv_.wait(lock, [this] { return open_; });
    }
    return inner_->Forward(in, out);
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  void Shut() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = false;
  }
  // The first token id of every forward started so far, in order.
  std::vector<int32_t> order() const {
    std::lock_guard<std::mutex> lock(mu_);
    return order_;
  }
  // Waits (up to a minute) until `n` forwards have started.
  bool WaitForForwards(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(60), [&] { return order_.size() >= n; });
  }

 private:
  Engine* const inner_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
  std::vector<int32_t> order_;
};

class GatedTarget {
 public:
  explicit GatedTarget(ServiceOptions options = {}) {
    model_ = *OpenModel("tiny-random:0");
    cpu_ = *CpuEngine::Create(model_.get(), 2);
    gated_ = std::make_unique<GatedEngine>(cpu_.get());
    service_ = std::make_unique<TargetService>(std::vector<Engine*>{gated_.get()}, options);
    LoopbackServer served = ServeOnLoopback(service_.get());
    server_ = std::move(served.server);
    address_ = std::move(served.address);
  }
  ~GatedTarget() {
    gated_->Open();
    service_->BeginDrain();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    service_->StopScheduler();
  }
  const std::string& address() const { return address_; }
  GatedEngine& engine() { return *gated_; }
  const Model& model() const { return *model_; }
  TargetService& service() { return *service_; }

 private:
  std::unique_ptr<Model> model_;
  std::unique_ptr<CpuEngine> cpu_;
  std::unique_ptr<GatedEngine> gated_;
  std::unique_ptr<TargetService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

}  // namespace draftfeed::testing
