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
  // Stripes: whole pages, at most kMaxStripes a block; none (0) is one stripe.
  if (opt_.stripe) {
    opt_.stripe = std::max(opt_.stripe - opt_.stripe % kAlign, kAlign);
    opt_.stripe = std::max(opt_.stripe, (opt_.block_size + kMaxStripes - 1) / kMaxStripes);
  }
  if (opt_.stripe >= opt_.block_size) opt_.stripe = 0;
  const size_t per_block = opt_.stripe ? (opt_.block_size + opt_.stripe - 1) / opt_.stripe : 1;
  // Every part of every block in flight fits in the engine.
  opt_.depth = std::max(1u, std::min<unsigned>(opt_.depth, unsigned(eng_.capacity() / per_block)));
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
    // A direct read is one part (its alignment rules); a buffered one is striped.
    size_t stripe = s.direct || opt_.stripe == 0 ? s.n : opt_.stripe;
    for (size_t at = 0; at < s.n || s.parts.empty(); at += stripe)
      s.parts.push_back(Part{at, std::min(stripe, s.n - at), 0, false});
    s.open = s.parts.size();
    queue_.push_back(std::move(s));
    const uint64_t seq = front_seq_ + queue_.size() - 1;
    for (size_t k = 0; k < queue_.back().parts.size(); ++k) submit(queue_.back(), seq, k);
  }
}

// Asks for the rest of one part. A direct read asks for whole pages (the last block's
// rounded up, which the block has room for; the file's end makes it short).
void ReadAhead::submit(Slot& s, uint64_t seq, size_t part) {
  Part& p = s.parts[part];
  Op op;
  op.code = OpCode::kRead;
  op.fd = s.direct ? opt_.direct_fd : opt_.fd;
  op.buf = s.data + p.at + p.got;
  size_t want = s.direct ? (p.n + kAlign - 1) / kAlign * kAlign : p.n;
  op.len = uint32_t(want - p.got);
  op.offset = s.offset + p.at + p.got;
  op.user_data = seq * kMaxStripes + part;
  int r = eng_.push(op);
  if (r != 0) throw Error::os(-r, "queue read of", opt_.name);
}

// Once the last part is done, the slot is: its bytes are those read from the start up
// to the first part that came back short (the file's end).
void ReadAhead::part_done(Slot& s, Part& p) {
  p.done = true;
  if (--s.open > 0) return;
  s.got = 0;
  for (const Part& q : s.parts) {
    s.got += std::min(q.got, q.n);
    if (q.got < q.n) break;
  }
  s.done = true;
}

void ReadAhead::complete(const Completion& c) {
  const uint64_t seq = c.user_data / kMaxStripes;
  const size_t part = size_t(c.user_data % kMaxStripes);
  Slot& s = queue_[size_t(seq - front_seq_)];
  Part& p = s.parts[part];
  if (c.res == -EINTR || c.res == -EAGAIN) return submit(s, seq, part);
  if (c.res == -EINVAL && s.direct) {
    // The file system refuses this alignment after all (or a read came back short off
    // a page, leaving the rest unaligned): buffered from here on.
    direct_ok_ = false;
    s.direct = false;
    return submit(s, seq, part);
  }
  if (c.res < 0) {
    if (s.err == 0) s.err = int(c.res);
    return part_done(s, p);
  }
  p.got += size_t(c.res);
  if (p.got >= p.n || c.res == 0) {  // whole, or the end of the file
    p.got = std::min(p.got, p.n);
    return part_done(s, p);
  }
  // A direct read short off a page (the file's end, or a device of 512-byte sectors
  // cutting it there): the rest of the block is read buffered, which tells which.
  if (s.direct && p.got % kAlign != 0) s.direct = false;
  submit(s, seq, part);
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
  Slot s = std::move(queue_.front());
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
    for (int k = 0; k < n; ++k) {
      Slot& s = queue_[size_t(cq[k].user_data / kMaxStripes - front_seq_)];
      part_done(s, s.parts[size_t(cq[k].user_data % kMaxStripes)]);
    }
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
