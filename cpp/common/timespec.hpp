// Nanoseconds since the epoch as the timespec futimens/utimensat take.
#pragma once

#include <time.h>

#include <cstdint>

namespace fastload {

// Floors toward minus infinity: a time before 1970 keeps 0 <= tv_nsec < 1e9.
inline timespec to_timespec(int64_t ns) {
  timespec t;
  t.tv_sec = time_t(ns / 1000000000);
  t.tv_nsec = long(ns % 1000000000);
  if (t.tv_nsec < 0) {
    t.tv_nsec += 1000000000;
    t.tv_sec -= 1;
  }
  return t;
}

}  // namespace fastload
