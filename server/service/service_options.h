// A target's serving options: the token budget, credits, caps, timeouts and
// transports, set from draftfeed-target's flags (or by a test) and fixed for
// the service's life.
#pragma once

#include <cstdint>
#include <memory>

#include "common/host_buffer_pool.h"
#include "common/nccl_hosts.h"
#include "server/service/auth_tokens.h"

namespace draftfeed {

struct ServiceOptions {
  int64_t max_batch_tokens = 16384;            // tokens of one forward
  // Most tokens of one Batch, and so its longest sequence: a batch over
  // max_batch_tokens runs in forward chunks, the engines carrying each
  // spanning sequence across them (they must have ReserveCarry'd this much).
  // At most max_batch_tokens (0 included): no chunking.
  int64_t max_sequence_tokens = 0;
  int32_t default_credits = 4;                 // Open.max_inflight_batches == 0
  int32_t max_credits = 32;                    // larger requests are clamped
  int64_t chunk_bytes = 4 << 20;               // payload per HiddenChunk (whole tokens)
  int64_t max_queued_batches = 256;            // scheduler backstop
  double throttle_tokens_per_s = 0;            // > 0: cap the engine's rate (benchmarks)
  int64_t host_pool_bytes = int64_t{2} << 30;  // idle capture buffers kept for reuse
  int64_t host_memory_cap_bytes = 0;           // capture buffers live + idle; 0 = no cap
  // Per stream: bytes of results taken for the forward and not yet written
  // (captures, and unsent BatchErrors); at this much the stream's batches
  // wait and other streams run on. 0 = no cap.
  int64_t max_stream_pending_bytes = int64_t{2048} << 20;
  int32_t max_streams = 64;            // open streams; the next is RESOURCE_EXHAUSTED
  // Open streams of one client: its bearer token's name when tokens are
  // checked, else its address (without the port); 0 = no share beyond
  // max_streams. A stream counts from its Open on, so that streams which
  // never send one cannot lock good clients out.
  int32_t max_streams_per_client = 0;
  // A stream that has sent no Open this long after it started is ended
  // (DEADLINE_EXCEEDED); 0 = never.
  double open_timeout_s = 10;
  double stream_idle_timeout_s = 300;  // a stream idle this long is ended; 0 = never
  // Per stream: batches refused (invalid, or sent while draining) beyond a
  // burst of kRejectBurst are read at most this many a second; a flood of
  // invalid batches costs the target reads and parses that no credit or
  // fair queue accounts for. 0 = unlimited.
  double max_rejects_per_s = 100;
  // Capture buffers' memory: pinned (PinnedHostAllocator) for GPU engines.
  HostAllocator host_allocator = HostAllocator::Heap();
  bool enable_nccl = true;             // offer TRANSPORT_NCCL (one GPU engine, NCCL built in)
  double nccl_timeout_s = 120.0;       // one batch's NCCL send must finish in this
  double nccl_setup_timeout_s = 60.0;  // a stream's NCCL set-up and handshake, likewise
  bool nccl_across_hosts = true;       // offer NCCL to trainers on other hosts too
  // The host trainers' Open.host_id is compared with; empty id: LocalHost().
  // Tests set it to make one machine's target and trainer look like two hosts.
  HostIdentity host;
  // Bearer tokens every call but health must carry (--auth_tokens_file);
  // null: none are checked.
  std::shared_ptr<const TokenChecker> tokens;
};

}  // namespace draftfeed
