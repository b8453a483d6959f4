// One side of the NCCL transport: a 2-rank communicator between a target
// (rank 0, sends) and a trainer (rank 1, receives), set up from the
// trainer's ncclUniqueId, which travels in Open. Every wait polls, so a peer
// that vanishes or hangs costs a timeout and an abort, never a stuck GPU.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace draftfeed {

class NcclPeer {
 public:
  static constexpr int kSenderRank = 0;    // the target
  static constexpr int kReceiverRank = 1;  // the trainer
  using Cancelled = std::function<bool()>;

  // A fresh ncclUniqueId (128 bytes) for the receiver to send in Open.
  static absl::StatusOr<std::string> NewUniqueId();

  // Starts joining the communicator on `device` (the calling thread's device
  // is set to it) and returns at once; Wait() finishes the join. A wait that
  // times out says `timeout_hint` (NcclSetupHint: what to check).
  static absl::StatusOr<std::unique_ptr<NcclPeer>> Start(const std::string& unique_id, int rank,
                                                         int device, std::string timeout_hint = "");
  ~NcclPeer();  // aborts the communicator (never waits for the other rank)
  NcclPeer(const NcclPeer&) = delete;
  NcclPeer& operator=(const NcclPeer&) = delete;

  // Waits until the communicator is up (the other rank joined), `cancelled`
  // returns true, or `timeout_s` passes; on failure the communicator is aborted.
  absl::Status Wait(double timeout_s, const Cancelled& cancelled = nullptr);

  // Both sides call this once, right after Wait, before any other op: a
  // small transfer of known bytes that connects the two GPUs (NCCL connects
  // a peer on its first transfer, which needs both sides in the call) and
  // proves the link delivers what was sent; then both split off the blocking
  // communicator that carries the payloads and connect it the same way.
  // After it, posting a send or receive never waits for the other side.
  absl::Status Handshake(double timeout_s, const Cancelled& cancelled = nullptr);
  static constexpr size_t kHandshakeBytes = 4096;
  static constexpr unsigned char kHandshakeByte = 0xd5;

  // A send or receive enqueued on a stream, with the payload's checksum
  // (v1::PayloadChecksum, computed on the GPU) enqueued beside it. Ops
  // complete in the order they were posted; at most kMaxOps are in flight.
  static constexpr int kMaxOps = 64;
  struct Op {
    int slot = -1;
    size_t bytes = 0;
  };
  // Send: the checksum reads the payload beside the send, on a stream of the
  // peer's own. Receive: after the bytes land.
  // Posting can itself wait (the first transfer connects the two GPUs, which
  // needs the other side's matching call): bounded like Wait.
  absl::StatusOr<Op> PostSend(const void* data, size_t bytes, void* stream, double timeout_s,
                              const Cancelled& cancelled = nullptr);
  absl::StatusOr<Op> PostRecv(void* data, size_t bytes, void* stream, double timeout_s,
                              const Cancelled& cancelled = nullptr);
  // Waits like Wait until what was enqueued on `op`'s stream before it is
  // done (for a send posted behind a forward: the forward ended, the payload
  // is there), not for the op itself.
  absl::Status WaitReady(const Op& op, double timeout_s, const Cancelled& cancelled = nullptr);
  // Waits for `op` like Wait; on success returns the payload's checksum.
  // `gpu_ms`, when given, gets the op's time on its stream's GPU timeline:
  // from where it was posted in the stream (the work enqueued before it done)
  // to its end. For the target's send, posted behind its forward: from the
  // forward's end to the send's end, the wait for the trainer's receive
  // included. For a receive posted after its send: the transfer itself.
  absl::StatusOr<uint64_t> WaitOp(const Op& op, double timeout_s,
                                  const Cancelled& cancelled = nullptr, double* gpu_ms = nullptr);

  // Post + WaitOp.
  absl::StatusOr<uint64_t> Send(const void* data, size_t bytes, void* stream, double timeout_s,
                                const Cancelled& cancelled = nullptr, double* gpu_ms = nullptr);
  absl::StatusOr<uint64_t> Recv(void* data, size_t bytes, void* stream, double timeout_s,
                                const Cancelled& cancelled = nullptr, double* gpu_ms = nullptr);

  // Unblocks every operation of this communicator (from any thread); it is
  // unusable afterwards.
  void Abort();
  int device() const { return device_; }
  // Replaces Start's timeout_hint (the trainer learns from Opened whether the
  // target is on another host only after it started joining).
  void SetTimeoutHint(std::string hint);

 private:
  struct Impl;
  NcclPeer(std::unique_ptr<Impl> impl, int device);
  absl::Status AbortWith(absl::Status why);  // logs why, aborts, returns why
  // The one wait loop: until `done` says so (null: until the communicator
  // has no operation in progress), the communicator reports an error,
  // `cancelled` fires or the timeout passes (the last three abort).
  absl::Status Poll(const char* what, const std::function<absl::StatusOr<bool>()>& done,
                    double timeout_s, const Cancelled& cancelled);
  absl::Status Exchange(double timeout_s, const Cancelled& cancelled);    // one handshake transfer
  absl::Status ShakeHands(double timeout_s, const Cancelled& cancelled);  // Handshake's body
  absl::StatusOr<Op> Post(bool send, void* data, size_t bytes, void* stream, double timeout_s,
                          const Cancelled& cancelled);
  std::unique_ptr<Impl> impl_;
  int device_;
};

// UUID of a CUDA device ("GPU-…"), empty when unknown.
std::string CudaDeviceUuid(int device);

}  // namespace draftfeed
