// ExtractJob::read_source(): the job reads its archive itself, through io::ReadAhead
// (issue 33), instead of being fed block by block by the caller.
#include <chrono>
#include <stdexcept>

#include "copy/extract_impl.hpp"
#include "io/readahead.hpp"

namespace fastload::copy {

SourceReads ExtractJob::read_source(const SourceFile& source,
                                    const std::function<void(uint64_t offset)>& tick) {
  Impl& im = *impl_;
  if (im.dead) throw Error(ErrorKind::kCancelled, 0, "extraction already failed", im.name);
  if (im.mapped) throw std::logic_error("ExtractJob::read_source: the archive is mapped");
  // The reads run on an engine of their own (the writes' engine is reaped by the
  // parser, deep inside feed), of the backend the job's rule chose: one name for both.
  io::EngineOptions eo;
  if (!io::parse_kind(im.engine_name, &eo.kind)) eo.kind = io::Kind::kPread;
  eo.depth = 2 * std::max(1u, source.depth) + 2;
  eo.threads = std::max(1u, source.depth);
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
  io::BlockLender lender{
      [this](bool wait) { return lend(wait); },
      [this](int b) { return block(b); },
      [this](int b) { release(b); },
  };
  io::ReadAheadOptions ro;
  ro.fd = source.fd;
  ro.direct_fd = source.direct_fd;
  ro.size = source.size;
  ro.block_size = block_size();
  ro.depth = source.depth;
  ro.name = im.name;
  // While a read is waited for, the writes' completions are reaped (freeing blocks and
  // slots) and a cancel is seen.
  auto poll = [&] {
    try {
      im.pump(false);
    } catch (...) {
      im.dead = true;
      im.abort();
      throw;
    }
    maybe_tick(false);
  };
  io::ReadAhead reader(*eng, std::move(lender), std::move(ro), poll);
  io::ReadAhead::Block b;
  bool first = true;
  SourceReads out;
  auto ns = [](Clock::duration d) {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
  };
  for (;;) {
    auto t0 = Clock::now();
    if (!reader.next(&b)) break;
    auto t1 = Clock::now();
    out.wait_ns += ns(t1 - t0);
    feed_block(b.index, b.n);
    at = b.offset + b.n;
    if (uint64_t skip = skippable(); skip >= block_size()) {
      skipped(skip);
      at += skip;
      reader.seek(at);
    }
    out.feed_ns += ns(Clock::now() - t1);
    maybe_tick(first);
    first = false;
  }
  out.bytes = reader.bytes_read();
  out.blocks = reader.blocks_read();
  out.direct_blocks = reader.direct_blocks();
  return out;
}

}  // namespace fastload::copy
