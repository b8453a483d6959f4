#include "server/service/target_signals.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <thread>
#include <utility>

#include "common/log_line.h"
#include "common/thread_name.h"

namespace draftfeed {
namespace {

sigset_t TargetSignalSet() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  return set;
}

const char* SignalName(int sig) {
  return sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "SIGHUP";
}

}  // namespace

void BlockTargetSignals() {
  const sigset_t set = TargetSignalSet();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

TargetSignals* TargetSignals::Start() {
  // Never deleted: the thread waits on it until the process exits.
  auto* signals = new TargetSignals();
  std::thread([signals] {
    NameThisThread("df-signals");
    signals->Loop();
  }).detach();
  return signals;
}

void TargetSignals::SetReload(std::function<void()> reload) {
  std::lock_guard<std::mutex> lock(mu_);
  reload_ = std::move(reload);
}

void TargetSignals::Serving(std::function<std::string()> abandoned) {
  std::lock_guard<std::mutex> lock(mu_);
  abandoned_ = std::move(abandoned);
  phase_ = Phase::kServing;
}

int TargetSignals::WaitForStop() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return stop_signal_ != 0; });
  return stop_signal_;
}

void TargetSignals::Drained() {
  std::lock_guard<std::mutex> lock(mu_);
  abandoned_ = nullptr;
}

void TargetSignals::Loop() {
  const sigset_t set = TargetSignalSet();
  for (;;) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    std::unique_lock<std::mutex> lock(mu_);
    if (sig == SIGHUP) {
      if (reload_ == nullptr) {
        LogF("draftfeed-target: SIGHUP: nothing to re-read (no --auth_tokens_file or "
             "--metrics_token_file)");
        continue;
      }
      // The reload runs outside the lock: it reads files and logs.
      std::function<void()> reload = reload_;
      lock.unlock();
      reload();
      continue;
    }
    switch (phase_) {
      case Phase::kLoading:
        LogF("draftfeed-target: %s received while loading: exiting, nothing was served",
             SignalName(sig));
        std::fflush(stderr);
        _exit(0);
      case Phase::kServing:
        phase_ = Phase::kDraining;
        stop_signal_ = sig;
        cv_.notify_all();
        break;
      case Phase::kDraining: {
        const std::string abandoned = abandoned_ != nullptr ? abandoned_() : "what is left";
        LogF("draftfeed-target: second %s during the drain: exiting now, abandoning %s",
             SignalName(sig), abandoned.c_str());
        std::fflush(stderr);
        _exit(1);
      }
    }
  }
}

}  // namespace draftfeed
