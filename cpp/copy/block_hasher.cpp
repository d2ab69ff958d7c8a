#include "copy/block_hasher.hpp"

#include <utility>

namespace fastload::copy {

BlockHasher::BlockHasher(HashFn fn) : fn_(std::move(fn)), thread_([this] { run(); }) {}

BlockHasher::~BlockHasher() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_.notify_all();
  thread_.join();
}

void BlockHasher::push(int block, const char* data, size_t n) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    todo_.push_back(Item{block, data, n});
    ++pending_;
  }
  work_.notify_one();
}

void BlockHasher::take_hashed(std::vector<int>* out) {
  std::lock_guard<std::mutex> lk(mu_);
  // Those hashed before a failure are handed back too: which ones they are does not
  // depend on when the caller looked.
  out->insert(out->end(), hashed_.begin(), hashed_.end());
  hashed_.clear();
  if (error_) std::rethrow_exception(error_);
}

size_t BlockHasher::pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  return pending_;
}

void BlockHasher::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  done_.wait_for(lk, timeout, [&] { return !hashed_.empty() || error_ || pending_ == 0; });
}

void BlockHasher::run() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    work_.wait(lk, [&] { return stop_ || (!todo_.empty() && !error_); });
    if (stop_) return;
    Item it = todo_.front();
    todo_.pop_front();
    // The block is the caller's until it is in hashed_: the hash reads it unlocked.
    lk.unlock();
    std::exception_ptr err;
    try {
      fn_(it.data, it.n);
    } catch (...) {
      err = std::current_exception();
    }
    lk.lock();
    --pending_;
    if (err)
      error_ = err;
    else
      hashed_.push_back(it.block);
    done_.notify_all();
  }
}

}  // namespace fastload::copy
