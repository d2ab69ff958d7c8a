// Fault injection for tests: an Engine that wraps another and, for a chosen share of
// operations, fails them with EIO, fails them with EINTR (without running them: the
// caller must retry), or halves the length of a read or write so it completes short.
//
// Configured by a spec string, from FASTLOAD_FAULTS at make_engine() time or passed to
// wrap_with_faults() directly:
//   "eio=0.01,eintr=0.1,short=0.2,seed=7,ops=read+write,after=100"
// eio/eintr/short: probabilities in [0, 1]; seed: the PRNG seed (deterministic);
// ops: which operations may be hit (read, write, open, close, statx; default read+write);
// after: the first N eligible operations are never hit (lets a job get going first).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "io/engine.hpp"

namespace fastload::io {

struct FaultSpec {
  double eio = 0.0;
  double eintr = 0.0;
  double short_io = 0.0;
  uint64_t seed = 0;
  uint32_t ops_mask = 0;  // bit (1 << OpCode)
  uint64_t after = 0;
};

// Parses a spec; returns false (and leaves *spec unspecified) on a malformed string.
bool parse_fault_spec(const std::string& text, FaultSpec* spec);

std::unique_ptr<Engine> wrap_with_faults(std::unique_ptr<Engine> inner, const FaultSpec& spec);

}  // namespace fastload::io
