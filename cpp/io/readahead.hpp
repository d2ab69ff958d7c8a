// Sequential read-ahead of one file through the I/O engine (issue 33): the file is read
// in order, in blocks the caller lends, `depth` blocks in flight on the engine (io_uring
// or the pread pool, whichever resolve_kind() gave the caller), and handed back in file
// order. What the Python Prefetcher did with a thread pool of preadv, in one place:
//   - a block whose bytes are not all in the page cache is read O_DIRECT (when the
//     caller gives a direct descriptor): the disk writes straight into the block, with
//     no copy through the cache and without filling it with a file read once; cached
//     blocks are still copied out of the cache (residency.hpp says which);
//   - after a seek to an unaligned offset, one short block (buffered) up to the next
//     page realigns the blocks after it, so they can be read direct again;
//   - with `stripe`, a buffered block is asked for in stripes of that size, each a read
//     of its own in flight (on a network file system, many requests at once cover
//     its latency: with the pread pool, a thread waits for each);
//   - EINTR/EAGAIN and short reads are retried; a file system that refuses a direct
//     read (EINVAL) is read buffered from then on, the block's rest included; a file found shorter than `size` is
//     Error(kSourceChanged) naming it; any other error is Error(kOs) naming it.
// One thread uses a ReadAhead (the engine is not thread-safe): the one that consumes.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "io/engine.hpp"

namespace fastload::io {

// Where the reader's buffers come from: the caller owns them (an ExtractJob lends its
// page-aligned read blocks). lend(wait): a free block's index, or -1 when none is free
// (with wait: the lender makes one free, or throws). data(b): its block_size bytes,
// page-aligned. release(b): the reader no longer uses it.
struct BlockLender {
  std::function<int(bool wait)> lend;
  std::function<char*(int block)> data;
  std::function<void(int block)> release;
};

struct ReadAheadOptions {
  int fd = -1;            // buffered reads
  int direct_fd = -1;     // O_DIRECT reads of uncached ranges; -1: none
  uint64_t size = 0;      // the bytes to read: the file's size when reading began
  size_t block_size = 8u << 20;  // a multiple of kAlign (O_DIRECT)
  unsigned depth = 8;     // blocks in flight
  size_t stripe = 0;      // buffered blocks read in stripes of this size; 0: whole
  std::string name;       // how errors name the file
};

class ReadAhead {
 public:
  static constexpr size_t kAlign = 4096;  // O_DIRECT: offsets, lengths and buffers
  static constexpr size_t kMaxStripes = 64;  // per block

  struct Block {
    uint64_t offset = 0;
    size_t n = 0;
    int index = -1;  // the lender's block
    const char* data = nullptr;
  };

  // engine: used by this reader alone while it lives (it reaps every completion).
  // poll(): called between waits of at most 100 ms for a read (the caller's other work:
  // reaping its writes, seeing a cancel); what it throws goes to the caller of next().
  ReadAhead(Engine& engine, BlockLender lender, ReadAheadOptions options,
            std::function<void()> poll);
  // Waits for the reads in flight (they write into lent blocks) and gives every block
  // back. Never throws.
  ~ReadAhead();
  ReadAhead(const ReadAhead&) = delete;
  ReadAhead& operator=(const ReadAhead&) = delete;

  // The next block in file order, once read; false at the end. The block stays the
  // caller's until the next call to next() or seek(), or the destructor, which give it
  // back. Throws Error (see above).
  bool next(Block* out);
  // Reads from `offset` next (a skipped member's data is not read): the reads in
  // flight are waited for and dropped.
  void seek(uint64_t offset);

  uint64_t bytes_read() const { return bytes_read_; }
  uint64_t blocks_read() const { return blocks_read_; }
  uint64_t direct_blocks() const { return direct_blocks_; }

 private:
  // One read of a block: [at, at + n) of it (the whole block unless striped).
  struct Part {
    size_t at = 0;
    size_t n = 0;
    size_t got = 0;
    bool done = false;
  };
  struct Slot {
    uint64_t offset = 0;
    size_t n = 0;
    int index = -1;
    char* data = nullptr;
    bool direct = false;  // one part only
    bool done = false;    // every part done: nothing in flight writes into the block
    size_t got = 0;       // once done: the bytes read from the start, up to a short part
    int err = 0;          // -errno
    std::vector<Part> parts;
    size_t open = 0;  // parts not done
  };
  void fill();
  void submit(Slot& s, uint64_t seq, size_t part);
  void part_done(Slot& s, Part& p);
  void complete(const Completion& c);
  void wait();  // one slice: reaps what completes within 100 ms, then poll()
  void give_back_current();
  void drain() noexcept;  // waits for every read in flight, gives their blocks back

  Engine& eng_;
  BlockLender lender_;
  ReadAheadOptions opt_;
  std::function<void()> poll_;
  std::deque<Slot> queue_;  // in file order; queue_[k] has sequence number front_seq_ + k
  uint64_t front_seq_ = 0;
  uint64_t next_ = 0;  // where the next block to queue starts
  int current_ = -1;   // the block the caller holds
  bool direct_ok_;     // false once the file system refused a direct read
  uint64_t bytes_read_ = 0;
  uint64_t blocks_read_ = 0;
  uint64_t direct_blocks_ = 0;
};

}  // namespace fastload::io
