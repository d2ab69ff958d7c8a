// A published checksum's hasher for an archive the job reads itself (issue 33): blocks
// handed over in file order are hashed, in that order, on a thread of its own, while
// the caller's thread feeds them to the extractor and reads the next ones.
//
// The caller owns the blocks: one pushed must stay unchanged and alive until
// take_hashed() has returned it (the hash function reads it meanwhile). One thread
// calls every method; the hash function runs on the hasher's thread only.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace fastload::copy {

class BlockHasher {
 public:
  using HashFn = std::function<void(const char* data, size_t n)>;
  explicit BlockHasher(HashFn fn);
  // Stops once the block being hashed is done (the rest are not hashed) and joins.
  ~BlockHasher();
  BlockHasher(const BlockHasher&) = delete;
  BlockHasher& operator=(const BlockHasher&) = delete;

  void push(int block, const char* data, size_t n);
  // The blocks hashed since the last call, in order, appended to `out` (the caller may
  // reuse them now). Then rethrows what the hash function threw (after which nothing
  // more is hashed).
  void take_hashed(std::vector<int>* out);
  // Pushed and not yet hashed.
  size_t pending() const;
  // Waits until a block is hashed, the hash function fails, or `timeout` passes.
  void wait(std::chrono::milliseconds timeout);

 private:
  struct Item {
    int block;
    const char* data;
    size_t n;
  };
  void run();

  HashFn fn_;
  mutable std::mutex mu_;
  std::condition_variable work_;  // the thread: an item, or stop
  std::condition_variable done_;  // the caller: a block hashed, or an error
  std::deque<Item> todo_;
  std::vector<int> hashed_;
  size_t pending_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace fastload::copy
