// A cancellation flag shared between the thread that runs a job and the one that
// may stop it (the Python thread handling Ctrl-C).
#pragma once

#include <atomic>

namespace fastload {

class CancelToken {
 public:
  void cancel() noexcept { flag_.store(true, std::memory_order_release); }
  bool cancelled() const noexcept { return flag_.load(std::memory_order_acquire); }

 private:
  std::atomic<bool> flag_{false};
};

}  // namespace fastload
