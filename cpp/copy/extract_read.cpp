// ExtractJob::read_source(): the job reads its archive itself, through io::ReadAhead
// (issue 33), instead of being fed block by block by the caller; a published
// checksum's hasher gets each block on a thread of its own (BlockHasher).
#include <chrono>
#include <optional>
#include <stdexcept>
#include <vector>

#include "copy/block_hasher.hpp"
#include "copy/extract_impl.hpp"
#include "io/readahead.hpp"

namespace fastload::copy {

namespace {

// The pread pool's threads for the reads: enough for 64 stripes in flight.
constexpr unsigned kMaxReadThreads = 64;

// The blocks a hasher holds. The reader gives a block back when the caller moves on;
// one still being hashed is kept from the job (which would reuse it) until it is hashed.
struct HeldBlocks {
  std::vector<bool> hashing;   // pushed to the hasher, not yet hashed
  std::vector<bool> deferred;  // ... and already given back by the reader
  std::vector<int> hashed;     // scratch for take_hashed()
};

}  // namespace

SourceReads ExtractJob::read_source(const SourceFile& source,
                                    const std::function<void(uint64_t offset)>& tick) {
  Impl& im = *impl_;
  if (im.dead) throw Error(ErrorKind::kCancelled, 0, "extraction already failed", im.name);
  if (im.mapped) throw std::logic_error("ExtractJob::read_source: the archive is mapped");
  // The reads run on an engine of their own (the writes' engine is reaped by the
  // parser, deep inside feed). Its backend is the rule's for the archive's file system,
  // from what the job was asked for: a network or FUSE one gets the pread pool, whose
  // threads each wait for a read, `depth` of them at once.
  io::EngineOptions eo;
  if (!source.where.empty()) {
    eo.kind = im.opt.engine.kind;
    eo.where = source.where;
  } else if (!io::parse_kind(im.engine_name, &eo.kind)) {
    eo.kind = io::Kind::kPread;
  }
  // Room for every read of `depth` blocks (each in stripes), a thread for each (the
  // pool's threads wait for their reads: on a network file system, its latency).
  const size_t stripes =
      source.stripe ? std::min((block_size() + source.stripe - 1) / source.stripe,
                               io::ReadAhead::kMaxStripes)
                    : 1;
  const unsigned reads = std::max(1u, source.depth) * unsigned(stripes);
  eo.depth = 2 * reads + 2;
  eo.threads = std::min(reads, kMaxReadThreads);
  int err = 0;
  std::unique_ptr<io::Engine> eng = io::make_engine(eo, &err);
  if (!eng) throw Error::os(-err, "start the I/O engine for", im.name);

  using Clock = std::chrono::steady_clock;
  const auto every = std::chrono::milliseconds(source.tick_ms);
  auto last = Clock::now();
  uint64_t at = 0;
  auto maybe_tick = [&](bool now) {
    if (!tick) return;
    auto t = Clock::now();
    if (!now && t - last < every) return;
    last = t;
    tick(at);
  };

  // With a hasher, the lender keeps blocks being hashed from the job (HeldBlocks), and
  // gives back those hashed since, on this thread, whenever the reader asks for one.
  std::optional<BlockHasher> hasher;
  HeldBlocks held;
  const size_t n_blocks = im.opt.read_blocks;
  held.hashing.assign(n_blocks, false);
  held.deferred.assign(n_blocks, false);
  auto settle = [&] {
    if (!hasher) return;
    held.hashed.clear();
    hasher->take_hashed(&held.hashed);
    for (int b : held.hashed) {
      held.hashing[size_t(b)] = false;
      if (held.deferred[size_t(b)]) {
        held.deferred[size_t(b)] = false;
        release(b);
      }
    }
  };
  io::BlockLender lender{
      [this, &settle](bool wait) {
        settle();
        return lend(wait);
      },
      [this](int b) { return block(b); },
      [this, &held](int b) {
        if (held.hashing[size_t(b)])
          held.deferred[size_t(b)] = true;
        else
          release(b);
      },
  };
  io::ReadAheadOptions ro;
  ro.fd = source.fd;
  ro.direct_fd = source.direct_fd;
  ro.size = source.size;
  ro.block_size = block_size();
  ro.depth = source.depth;
  ro.stripe = source.stripe;
  ro.name = im.name;
  // While a read (or the hasher) is waited for, the writes' completions are reaped
  // (freeing blocks and slots) and a cancel is seen.
  auto poll = [&] {
    try {
      im.pump(false);
    } catch (...) {
      im.dead = true;
      im.abort();
      throw;
    }
    settle();
    maybe_tick(false);
  };
  io::ReadAhead reader(*eng, std::move(lender), std::move(ro), poll);
  // Blocks in flight, the one fed, and those the hasher lags behind by must leave the
  // job a block to lend: lend(wait) with none free and no write pending would throw.
  const size_t in_reader = size_t(std::min(source.depth, eng->capacity())) + 2;
  const size_t lag = std::min<size_t>(source.hash_lag,
                                      n_blocks > in_reader ? n_blocks - in_reader : 0);
  if (source.hash) hasher.emplace(source.hash);
  // Declared after the reader, so destroyed first: on the way out (an error), the
  // hasher stops before the reader gives its blocks back, and the blocks it kept from
  // the job are given back.
  struct StopHasher {
    std::optional<BlockHasher>& hasher;
    HeldBlocks& held;
    ExtractJob& job;
    ~StopHasher() {
      hasher.reset();
      for (size_t b = 0; b < held.hashing.size(); ++b) {
        held.hashing[b] = false;
        if (held.deferred[b]) {
          held.deferred[b] = false;
          try {
            job.release(int(b));
          } catch (...) {  // a job that no longer knows the block: nothing to give back
          }
        }
      }
    }
  } stop_hasher{hasher, held, *this};

  io::ReadAhead::Block b;
  bool first = true;
  SourceReads out;
  auto ns = [](Clock::duration d) {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
  };
  // Until at most `most` blocks are still to be hashed, reaping writes meanwhile.
  auto catch_up = [&](size_t most) {
    if (!hasher || hasher->pending() <= most) return;
    auto t0 = Clock::now();
    while (hasher->pending() > most) {
      hasher->wait(std::chrono::milliseconds(100));
      poll();
    }
    settle();
    out.hash_wait_ns += ns(Clock::now() - t0);
  };
  for (;;) {
    catch_up(lag);
    auto t0 = Clock::now();
    if (!reader.next(&b)) break;
    auto t1 = Clock::now();
    out.wait_ns += ns(t1 - t0);
    if (hasher) {
      // Hashed while it is fed: the writes only read the block too.
      held.hashing[size_t(b.index)] = true;
      hasher->push(b.index, b.data, b.n);
    }
    feed_block(b.index, b.n);
    at = b.offset + b.n;
    if (uint64_t skip = hasher ? 0 : skippable(); skip >= block_size()) {
      skipped(skip);
      at += skip;
      reader.seek(at);
    }
    out.feed_ns += ns(Clock::now() - t1);
    maybe_tick(first);
    first = false;
  }
  catch_up(0);
  out.bytes = reader.bytes_read();
  out.blocks = reader.blocks_read();
  out.direct_blocks = reader.direct_blocks();
  out.engine = eng->name();
  return out;
}

}  // namespace fastload::copy
