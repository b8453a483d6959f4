// draftfeed-target's signals: SIGTERM, SIGINT and SIGHUP are blocked in main
// before any thread starts, so that every thread inherits the block and none
// dies of a signal's default action (gRPC's threads used to start first, and
// a SIGHUP during the model load killed the target), and one thread takes
// them in every phase:
//
//   loading:  SIGTERM/SIGINT exit at once with status 0 (nothing was served);
//   serving:  SIGTERM/SIGINT begin the drain (WaitForStop returns);
//   draining: a second SIGTERM/SIGINT exits at once with status 1, logging
//             what it abandons;
//   always:   SIGHUP runs the reload (re-reading the token files) and never
//             ends the target.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>

namespace draftfeed {

// Blocks SIGTERM, SIGINT and SIGHUP in the calling thread: first thing in main.
void BlockTargetSignals();

class TargetSignals {
 public:
  // Starts the thread that takes the blocked signals; the object lives until
  // the process exits (the thread never ends).
  static TargetSignals* Start();

  // SIGHUP from now on runs `reload` on the signal thread.
  void SetReload(std::function<void()> reload);
  // The target serves: SIGTERM/SIGINT now begin the drain, and a second one
  // exits, logging `abandoned()` ("2 open streams, 5 queued batches").
  void Serving(std::function<std::string()> abandoned);
  // Blocks until SIGTERM or SIGINT arrives while serving; returns it.
  int WaitForStop();
  // The drain has finished: `abandoned` is not called again.
  void Drained();

 private:
  TargetSignals() = default;
  void Loop();

  enum class Phase { kLoading, kServing, kDraining };
  std::mutex mu_;
  std::condition_variable cv_;
  Phase phase_ = Phase::kLoading;
  int stop_signal_ = 0;
  std::function<void()> reload_;
  std::function<std::string()> abandoned_;
};

}  // namespace draftfeed
