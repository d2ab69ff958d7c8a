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
// Two rules keep a block from going back too early:
//  - Only the process that took a lease gives its count back: a process forked while it
//    held one (a DataLoader worker started by the main process) drops its copy of the
//    lease without touching the count, which belongs to the parent's.
//  - A receiver's mapping may be held (View::hold): the block is registered with CUDA
//    there, so a copy issued from it may still be reading it after every tensor over it
//    is gone. A lease on a held mapping does not give its count back when destroyed: the
//    count moves to this process's list of retired counts, which the receiver takes
//    (Retired::take), and gives back once every copy issued before has completed.
//
// Blocks outlive their worker (the main process keeps the mappings of an exited
// worker's blocks, and hands them to workers it forks later): the header also holds the
// block's owner, the process that writes batches into it (its creator, else 0: free). A
// worker claims a free block (Block::claim: compare-and-swap 0 -> its pid, so of several
// workers forked from one state one gets it); the main process frees a block
// (View::disown) once its owner has exited or named the block let go of. The lease
// count still says when the owner may write into it.
//
// Errors: constructors throw Error(kOs) naming "fastload batch block"; nothing else
// throws. Every member is safe to call from any thread; the count is the only state the
// two processes share.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "common/unique_fd.hpp"

namespace fastload::shm {

inline constexpr size_t kHeaderBytes = 64;  // the payload starts on a cache line

// One mapping of a block (header + payload), unmapped when the last holder goes.
class Mapping;

class Lease {
 public:
  // Takes over one count already on the block (Block::lease() or the sender's retain()),
  // for this process.
  explicit Lease(std::shared_ptr<Mapping> map) noexcept;
  // Gives the count back (release order: the payload's writes come first), or retires it
  // where the mapping is held; in another process (a forked child), neither.
  ~Lease();
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  char* data() const noexcept;
  size_t capacity() const noexcept;

 private:
  std::shared_ptr<Mapping> map_;
  pid_t pid_;
};

// Counts retired by leases on held mappings (see above), taken off this process's list.
// release() (or destruction) gives back those retired by this process (none of those a
// forked child finds in the list it inherited).
class Retired {
 public:
  // Every count retired in this process since the last take.
  static Retired take();
  Retired() noexcept;
  ~Retired();  // release()
  Retired(Retired&&) noexcept = default;
  Retired& operator=(Retired&&) = delete;
  Retired(const Retired&) = delete;
  Retired& operator=(const Retired&) = delete;

  size_t size() const noexcept { return maps_.size(); }
  void release() noexcept;

 private:
  std::vector<std::pair<std::shared_ptr<Mapping>, pid_t>> maps_;  // with the retiring process
};

class Block {
 public:
  // A block whose payload holds at least `capacity` bytes (the whole mapping is rounded
  // up to pages, so capacity() may be larger), with no leases, owned by this process.
  explicit Block(size_t capacity);
  // The existing block behind fd (a descriptor of it this process inherited; duplicated
  // here, fd stays the caller's), owned by this process from now on if it was free;
  // nullptr if another process owns it. Its lease count is left as it is. Throws
  // Error(kOs) when fd is not a batch block.
  static std::unique_ptr<Block> claim(int fd);
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
  Block() = default;
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
  // Held: leases on this mapping retire their counts instead of giving them back (set
  // while the block is registered with CUDA here). Applies to leases destroyed from now
  // on, already taken ones included.
  void hold(bool on) noexcept;
  bool held() const noexcept;
  // Leases on the block, in every process.
  uint32_t users() const noexcept;
  // The process that writes batches into the block (0: none; Block::claim may take it).
  uint32_t owner() const noexcept;
  // Frees the block for a claim: call only once its owner has exited or let it go.
  void disown() noexcept;

 private:
  std::shared_ptr<Mapping> map_;
};

}  // namespace fastload::shm
