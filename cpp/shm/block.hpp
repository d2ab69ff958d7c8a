// Shared-memory blocks that a DataLoader worker reuses from batch to batch, and the
// lease protocol that says when a block is free again.
//
// A fresh shared-memory segment per batch (what torch allocates for a tensor in a
// worker) costs a page fault, a page of zeroes and a page-cache insertion for every
// 4 KiB of it, and a truncation when it is freed: on a batch of 25 MB that is most of
// the time it takes to fill. A worker instead keeps a few memfd blocks and writes each
// batch into one that the receiving process has finished with.
//
// Who has finished is counted in the block itself: a 64-byte header at the start of the
// mapping holds a magic and a count of the leases on the block, updated atomically by
// both processes (the same physical page is mapped in each).
//  - Block (sender): owns the memfd and a mapping. lease() returns a Lease (+1);
//    retain() adds one count for a lease that another process will take over
//    (View::adopt there), called while the sender's own lease is still alive, so the
//    count cannot drop to zero while a batch is on its way.
//  - Lease: the block's writable payload; its destruction gives its count back.
//  - View (receiver): its mapping of a block received from the sender, kept from batch
//    to batch; adopt() is the lease taking over the count the sender retained.
// A block is free for the next batch when its count is zero: every lease over the last
// batch written into it is gone, in both processes.
//
// Errors: constructors throw Error(kOs) naming "fastload batch block"; nothing else
// throws. Every member is safe to call from any thread; the count is the only state the
// two processes share.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "common/unique_fd.hpp"

namespace fastload::shm {

inline constexpr size_t kHeaderBytes = 64;  // the payload starts on a cache line

// One mapping of a block (header + payload), unmapped when the last holder goes.
class Mapping;

class Lease {
 public:
  // Takes over one count already on the block (Block::lease() or the sender's retain()).
  explicit Lease(std::shared_ptr<Mapping> map) noexcept;
  ~Lease();  // gives the count back (release order: the payload's writes come first)
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  char* data() const noexcept;
  size_t capacity() const noexcept;

 private:
  std::shared_ptr<Mapping> map_;
};

class Block {
 public:
  // A block whose payload holds at least `capacity` bytes (the whole mapping is rounded
  // up to pages, so capacity() may be larger), with no leases.
  explicit Block(size_t capacity);
  ~Block();
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;

  // Leases now on the block, in every process.
  uint32_t users() const noexcept;
  std::unique_ptr<Lease> lease();
  // One count for a lease the receiving process will adopt (View::adopt).
  void retain() noexcept;

  int fd() const noexcept { return fd_.get(); }  // the memfd, to hand to the receiver
  size_t length() const noexcept;                 // of the mapping: what View needs
  size_t capacity() const noexcept;               // payload bytes
  uintptr_t address() const noexcept;             // of the payload in this process
  uint64_t inode() const noexcept { return inode_; }  // the memfd's, for the receiver's cache

 private:
  UniqueFd fd_;
  uint64_t inode_ = 0;
  std::shared_ptr<Mapping> map_;
};

class View {
 public:
  // Maps the block behind fd (received from the sender; owned and closed here) as a
  // mapping of `length` bytes. Error(kOs, EINVAL) when the file is shorter than
  // announced, length leaves no payload, or the file is not a batch block (its magic).
  View(int fd, size_t length);
  ~View();
  View(const View&) = delete;
  View& operator=(const View&) = delete;

  // A lease taking over the count the sender retained for this batch.
  std::unique_ptr<Lease> adopt();
  size_t length() const noexcept;
  // Leases on the block, in every process.
  uint32_t users() const noexcept;

 private:
  std::shared_ptr<Mapping> map_;
};

}  // namespace fastload::shm
