// The capture pipeline: two capture buffers, so that batch N's capture is
// copied to the host (ForwardAsync) or handed to a device sink (an NCCL send,
// ForwardToDevice) while batch N+1's forward fills the other; a copy thread
// retires them in order.
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/payload_checksum.h"
#include "common/status_macros.h"
#include "kernels/capture_fp8.cuh"
#include "kernels/checksum.cuh"
#include "server/model/cuda_engine_impl.h"

namespace draftfeed {

// The buffer the next forward writes: the other one than last time, once the
// copy out of it (if any) is retired. A forward of batch N+1 therefore runs
// while batch N's capture is copied, and never overwrites it.
int CudaEngine::Impl::TakeBuffer() {
  const int b = 1 - current;
  std::unique_lock<std::mutex> lock(copy_mu);
  copy_cv.wait(lock, [&] { return !busy[b]; });
  current = b;
  capture = captures[b];
  return b;
}

void CudaEngine::Impl::Queue(PendingCopy job) {
  {
    std::lock_guard<std::mutex> lock(copy_mu);
    busy[job.buffer] = true;
    pending.push_back(std::move(job));
  }
  copy_cv.notify_all();
}

void CudaEngine::Impl::CopyLoop() {
  cudaSetDevice(options.device);
  for (;;) {
    PendingCopy job;
    {
      std::unique_lock<std::mutex> lock(copy_mu);
      copy_cv.wait(lock, [&] { return stop_copier || !pending.empty(); });
      if (pending.empty()) return;  // stopping and drained
      job = std::move(pending.front());
      pending.pop_front();
    }
    Copied done;
    if (job.sink_wait) {
      done = job.sink_wait();
      if (!job.forward_status.ok()) done.status = job.forward_status;
    } else if (const cudaError_t e = cudaEventSynchronize(copied[job.buffer]); e == cudaSuccess) {
      done.checksum =
          v1::FinishPayloadChecksum(h_lanes + job.buffer * v1::kChecksumLanes, job.bytes);
    } else {
      done.status = CudaError(e, "device-to-host copy of the capture");
    }
    job.on_copied(std::move(done));
    {
      std::lock_guard<std::mutex> lock(copy_mu);
      busy[job.buffer] = false;
    }
    copy_cv.notify_all();
  }
}

absl::StatusOr<const void*> CudaEngine::Impl::Payload(int b, const ForwardInput& in,
                                                      cudaStream_t s) {
  const int64_t T = static_cast<int64_t>(in.token_ids.size());
  const int64_t K = static_cast<int64_t>(in.layers.size());
  const void* hidden = captures[b];
  if (in.encoding == CaptureEncoding::kFp8E4m3 && K > 0) {
    if (fp8_captures[0] == nullptr || fp8_captures[1] == nullptr) {
      const size_t bytes =
          static_cast<size_t>(options.max_tokens * CaptureBytesPerToken(CaptureEncoding::kFp8E4m3,
                                                                        options.max_layers, D));
      for (uint8_t*& p : fp8_captures) {
        if (p != nullptr) continue;
        if (const cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess) {
          p = nullptr;
          return absl::ResourceExhaustedError(
              absl::StrCat("cannot allocate the two ", bytes >> 20,
                           " MiB fp8_e4m3 capture buffers: ", cudaGetErrorString(e)));
        }
      }
    }
    // Encoded from the bf16 capture: the final norm's fp32 values never exist
    // in memory (its kernel writes bf16), so every slot is encoded alike.
    DF_CUDA(cuda::EncodeFp8Capture(captures[b], T, K, D, fp8_captures[b], s));
    hidden = fp8_captures[b];
  }
  if (!in.wants_outputs()) return hidden;
  // The forward wrote each token's outputs after its hidden part: the rows
  // go out whole, so the checksum, the host copy and a device sink carry
  // them with no change of their own.
  const size_t hidden_bytes = static_cast<size_t>(CaptureBytesPerToken(in.encoding, K, D));
  const size_t row = static_cast<size_t>(RowBytesPerToken(model->config, in));
  if (hidden_bytes > 0 && T > 0) {
    DF_CUDA(cudaMemcpy2DAsync(rows[b], row, hidden, hidden_bytes, hidden_bytes,
                              static_cast<size_t>(T), cudaMemcpyDeviceToDevice, s));
  }
  return rows[b];
}

void CudaEngine::Impl::StopCopier() {
  if (!copier.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(copy_mu);
    stop_copier = true;
  }
  copy_cv.notify_all();
  copier.join();
}

absl::Status CudaEngine::Forward(const ForwardInput& in, std::span<std::byte> out) {
  DF_RETURN_IF_ERROR(CheckCaptureOutput(*this, in, out.size()));
  const int b = impl_->TakeBuffer();
  DF_RETURN_IF_ERROR(impl_->Run(in));
  DF_ASSIGN_OR_RETURN(const void* payload, impl_->Payload(b, in, impl_->stream));
  DF_CUDA(cudaStreamSynchronize(impl_->stream));
  DF_CUDA(cudaMemcpy(out.data(), payload, impl_->CaptureBytes(in), cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

absl::Status CudaEngine::ForwardAsync(const ForwardInput& in, std::span<std::byte> out,
                                      CopiedCallback on_copied) {
  DF_RETURN_IF_ERROR(CheckCaptureOutput(*this, in, out.size()));
  Impl& m = *impl_;
  const int b = m.TakeBuffer();
  // Run ends with the compute stream synchronised, so the copy stream needs
  // no event to order itself after the forward.
  DF_RETURN_IF_ERROR(m.Run(in));
  const size_t bytes = m.CaptureBytes(in);
  // An fp8 encoding runs on the copy stream too, beside the next forward.
  DF_ASSIGN_OR_RETURN(const void* payload, m.Payload(b, in, m.copy_stream));
  DF_CUDA(cudaMemcpyAsync(out.data(), payload, bytes, cudaMemcpyDeviceToHost, m.copy_stream));
  // The checksum is taken on the GPU beside the copy (tens of microseconds),
  // not by a pass over the host copy on the target's CPU; it covers the
  // payload sent (the fp8 bytes for fp8_e4m3).
  DF_CUDA(cuda::EnqueuePayloadLanes(payload, bytes, m.d_lanes + b * v1::kChecksumLanes,
                                    m.h_lanes + b * v1::kChecksumLanes, m.copy_stream));
  DF_CUDA(cudaEventRecord(m.copied[b], m.copy_stream));
  m.Queue(Impl::PendingCopy{b, bytes, std::move(on_copied)});
  return absl::OkStatus();
}

absl::Status CudaEngine::ForwardToDevice(const ForwardInput& in, const DeviceSink& sink,
                                         CopiedCallback on_sent) {
  DF_RETURN_IF_ERROR(CheckEncodingServed(*this, in.encoding));
  DF_RETURN_IF_ERROR(CheckOutputsServed(*this, in));
  Impl& m = *impl_;
  // TakeBuffer waits out any copy or send still reading the buffer; the one
  // this batch's sink starts keeps it busy until its DeviceWait returns.
  const int b = m.TakeBuffer();
  DF_RETURN_IF_ERROR(m.Run(in, /*sync=*/false));
  DF_CUDA(cudaEventRecord(m.forwarded[b], m.stream));
  DF_CUDA(cudaStreamWaitEvent(m.send_stream, m.forwarded[b], 0));
  DeviceView view;
  absl::StatusOr<const void*> payload = m.Payload(b, in, m.send_stream);
  if (!payload.ok()) {
    cudaStreamSynchronize(m.stream);  // nothing is left running on an error return
    cudaStreamSynchronize(m.send_stream);
    return payload.status();
  }
  view.data = *payload;
  view.bytes = m.CaptureBytes(in);
  view.encoding = in.encoding;
  view.bytes_per_token = RowBytesPerToken(m.model->config, in);
  view.device = m.options.device;
  view.stream = m.send_stream;
  // The sink is called while the forward runs, so its host-side work (an
  // NCCL send: ~0.35 ms) is done by the time the capture is ready.
  absl::StatusOr<DeviceWait> wait = sink(view);
  const cudaError_t e = cudaStreamSynchronize(m.stream);
  absl::Status forward = e == cudaSuccess ? absl::OkStatus() : CudaError(e, "forward");
  if (!wait.ok()) return forward.ok() ? wait.status() : forward;
  m.Queue(
      Impl::PendingCopy{b, view.bytes, std::move(on_sent), *std::move(wait), std::move(forward)});
  return absl::OkStatus();
}

}  // namespace draftfeed
