// draftfeed-bench's checkpoint modes:
//
//   draftfeed-bench write-random --model random:qwen3-8b --out DIR --shards 4
//   draftfeed-bench load --model DIR --device 0 --repeats 3
//
// `write-random` saves a real-size random bf16 checkpoint of a built-in shape
// (weights drawn in parallel, written by the HF writer). `load` times, in one
// run and from a cold page cache each time, reading the checkpoint's files
// raw in parallel (the disk's speed) and loading the model onto the GPU
// through the engine (LoadModel + CudaEngine::Create), and prints the medians
// and their ratio.
#pragma once

#include <string>

namespace draftfeed::bench {

int WriteRandomCheckpoint(const std::string& spec);
int RunLoadBench(const std::string& dir, int device);

}  // namespace draftfeed::bench
