// Names the calling thread (as top -H, /proc/*/task/*/comm and bench/thread_cpu.py
// show it), so a profile says which part of the data plane is busy. Linux
// keeps 15 characters.
#pragma once

#include <pthread.h>

namespace draftfeed {

inline void NameThisThread(const char* name) { pthread_setname_np(pthread_self(), name); }

}  // namespace draftfeed
