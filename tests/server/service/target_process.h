// A draftfeed-target process (DRAFTFEED_TARGET_BIN) on the tiny random model
// and a free loopback port: for the tests that need the binary's own flags
// and start-up, not an in-process TargetService.
#pragma once

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace draftfeed::testing {

class TargetProcess {
 public:
  // Starts the binary with `flags` after the model, listen address and port
  // file; address() is empty when it did not start serving within 60 s.
  explicit TargetProcess(const std::vector<std::string>& flags, const std::string& name) {
    namespace fs = std::filesystem;
    const fs::path dir = fs::path(::testing::TempDir()) / name;
    fs::create_directories(dir);
    const std::string port_file = (dir / "port").string();
    fs::remove(port_file);
    std::vector<std::string> args = {DRAFTFEED_TARGET_BIN, "--model=tiny-random",
                                     "--listen=127.0.0.1:0", "--threads=1",
                                     "--port_file=" + port_file};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, argv[0], nullptr, nullptr, argv.data(), environ) != 0) {
      pid_ = 0;
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    int port = 0;
    while (port == 0 && std::chrono::steady_clock::now() < deadline) {
      std::ifstream(port_file) >> port;
      if (port == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (port != 0) address_ = "127.0.0.1:" + std::to_string(port);
  }
  ~TargetProcess() {
    if (pid_ != 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  TargetProcess(const TargetProcess&) = delete;
  TargetProcess& operator=(const TargetProcess&) = delete;

  const std::string& address() const { return address_; }

  // SIGTERM, then the wait for its exit: its wait status (-1 when none ran).
  int Terminate() {
    if (pid_ == 0) return -1;
    kill(pid_, SIGTERM);
    int status = 0;
    if (waitpid(pid_, &status, 0) != pid_) status = -1;
    pid_ = 0;
    return status;
  }

 private:
  pid_t pid_ = 0;
  std::string address_;
};

}  // namespace draftfeed::testing
