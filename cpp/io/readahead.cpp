#include "io/readahead.hpp"

#include <algorithm>
#include <cerrno>
#include <utility>

#include "common/error.hpp"
#include "io/residency.hpp"

namespace fastload::io {

ReadAhead::ReadAhead(Engine& engine, BlockLender lender, ReadAheadOptions options,
                     std::function<void()> poll)
    : eng_(engine), lender_(std::move(lender)), opt_(std::move(options)), poll_(std::move(poll)),
      direct_ok_(opt_.direct_fd >= 0) {
  if (opt_.block_size < kAlign || opt_.block_size % kAlign != 0) direct_ok_ = false;
  opt_.depth = std::max(1u, std::min(opt_.depth, eng_.capacity()));
}

ReadAhead::~ReadAhead() {
  drain();
  try {
    give_back_current();
  } catch (...) {
  }
}

void ReadAhead::give_back_current() {
  if (current_ >= 0) lender_.release(std::exchange(current_, -1));
}

// Queues reads until `depth` are in flight or the file is all asked for. A block is
// waited for (the lender reaps its writes) only when nothing is being read: else the
// reads in flight are what the caller waits for first.
void ReadAhead::fill() {
  while (queue_.size() < opt_.depth && next_ < opt_.size) {
    int b = lender_.lend(queue_.empty());
    if (b < 0) return;
    Slot s;
    s.offset = next_;
    s.index = b;
    s.data = lender_.data(b);
    // Unaligned (after a seek): a short block up to the next page.
    s.n = next_ % kAlign == 0 ? opt_.block_size : kAlign - next_ % kAlign;
    s.n = size_t(std::min<uint64_t>(s.n, opt_.size - next_));
    next_ += s.n;
    if (direct_ok_ && s.offset % kAlign == 0) {
      int err = 0;
      // Cannot tell (the file cannot be mapped): read through the cache.
      s.direct = cached_bytes(opt_.fd, s.offset, s.n, &err) != s.n && err == 0;
    }
    queue_.push_back(s);
    submit(queue_.back(), front_seq_ + queue_.size() - 1);
  }
}

// Asks for the rest of the slot's range. A direct read asks for whole pages (the last
// block's rounded up, which the block has room for; the file's end makes it short).
void ReadAhead::submit(Slot& s, uint64_t seq) {
  Op op;
  op.code = OpCode::kRead;
  op.fd = s.direct ? opt_.direct_fd : opt_.fd;
  op.buf = s.data + s.got;
  size_t want = s.direct ? (s.n + kAlign - 1) / kAlign * kAlign : s.n;
  op.len = uint32_t(want - s.got);
  op.offset = s.offset + s.got;
  op.user_data = seq;
  int r = eng_.push(op);
  if (r != 0) throw Error::os(-r, "queue read of", opt_.name);
}

void ReadAhead::complete(const Completion& c) {
  Slot& s = queue_[size_t(c.user_data - front_seq_)];
  if (c.res == -EINTR || c.res == -EAGAIN) return submit(s, c.user_data);
  if (c.res == -EINVAL && s.direct) {
    // The file system refuses this alignment after all (or a read came back short off
    // a page, leaving the rest unaligned): buffered from here on.
    direct_ok_ = false;
    s.direct = false;
    return submit(s, c.user_data);
  }
  if (c.res < 0) {
    s.err = int(c.res);
    s.done = true;
    return;
  }
  s.got += size_t(c.res);
  if (s.got >= s.n || c.res == 0) {  // whole, or the end of the file
    s.got = std::min(s.got, s.n);
    s.done = true;
    return;
  }
  // A direct read short off a page (the file's end, or a device of 512-byte sectors
  // cutting it there): the rest of the block is read buffered, which tells which.
  if (s.direct && s.got % kAlign != 0) s.direct = false;
  submit(s, c.user_data);
}

void ReadAhead::wait() {
  Completion cq[64];
  int n = eng_.reap(cq, 64, eng_.in_flight() > 0 ? 1 : 0, 100);
  if (n < 0) throw Error::os(-n, "wait for reads of", opt_.name);
  for (int k = 0; k < n; ++k) complete(cq[k]);
  if (poll_) poll_();
}

bool ReadAhead::next(Block* out) {
  give_back_current();
  fill();
  if (queue_.empty()) return false;
  while (!queue_.front().done) wait();
  Slot s = queue_.front();
  if (s.err < 0) throw Error::os(-s.err, "read", opt_.name);
  if (s.got != s.n)
    throw Error(ErrorKind::kSourceChanged, EIO, "source file changed", opt_.name,
                "it is shorter than when staging began; stage again to pick up the new "
                "content");
  queue_.pop_front();
  ++front_seq_;
  current_ = s.index;
  bytes_read_ += s.n;
  ++blocks_read_;
  if (s.direct) ++direct_blocks_;
  fill();
  *out = Block{s.offset, s.n, s.index, s.data};
  return true;
}

void ReadAhead::seek(uint64_t offset) {
  give_back_current();
  drain();
  next_ = std::min(offset, opt_.size);
}

void ReadAhead::drain() noexcept {
  Completion cq[64];
  auto in_flight = [&] {
    return std::any_of(queue_.begin(), queue_.end(), [](const Slot& s) { return !s.done; });
  };
  while (in_flight()) {
    int n = eng_.reap(cq, 64, 1, 100);
    if (n < 0) break;  // the engine is broken: nothing more will complete
    // A completed read is done, whatever it read: nothing is asked again.
    for (int k = 0; k < n; ++k) queue_[size_t(cq[k].user_data - front_seq_)].done = true;
  }
  for (const Slot& s : queue_) {
    try {
      lender_.release(s.index);
    } catch (...) {  // a lender that no longer knows the block: nothing to give back
    }
  }
  front_seq_ += queue_.size();
  queue_.clear();
}

}  // namespace fastload::io
