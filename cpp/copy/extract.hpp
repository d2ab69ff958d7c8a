// Streaming extraction of a tar archive (optionally compressed, optionally with member
// tars extracted too) into a destination directory.
//
// The caller feeds the archive's bytes in order (the Python layer reads them in large
// sequential, prefetched reads), or the job reads an archive file itself (read_source():
// io::ReadAhead on an engine of the backend the engine rule gives the archive's file
// system, a published checksum's hasher handed each block on a thread of its own).
// Members are
// decoded as they arrive and their data is written with many writes in flight through
// the I/O engine; nothing is staged to disk twice, and an inner tar ("nested") is parsed
// from the outer one's data without ever being written.
//
// Read blocks: the caller may read the archive into buffers the job lends (lend(),
// feed_block(), release()) instead of its own. An uncompressed archive's member data is
// then written straight from those blocks, each pinned until its writes complete: the
// bytes are copied once by the read and once by the write, never in between. Data fed
// any other way (feed(), or decoded from gzip/zstd) is copied into write slots.
//
// Safety: every member path is normalised and refused if absolute or escaping; every
// directory is opened component by component from the destination with O_NOFOLLOW, so
// nothing is ever written through a symlink (an archive's own, or one planted before);
// links leaving the destination, devices and FIFOs are refused; a file never replaces a
// directory. Files are created unnamed (O_TMPFILE) or as hidden temporaries, and named
// only once whole.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "copy/decompress.hpp"
#include "io/engine.hpp"

namespace fastload::copy {

struct ExtractOptions {
  io::EngineOptions engine;
  Compression compression = Compression::kNone;
  bool nested = false;               // also extract members named *.tar into <name>/
  std::vector<std::string> include;  // globs on output paths
  std::vector<std::string> exclude;
  // Output paths already complete on disk (from an interrupted run): (size, mtime_ns).
  // Such members are skipped, not rewritten.
  std::unordered_map<std::string, std::pair<uint64_t, int64_t>> complete;
  // Members already at their final path with the right size, mode and mtime, but not in
  // `complete`, are read back and digested instead of rewritten. Only sound when the
  // machine has not rebooted since they were written (a killed run, not a power loss):
  // files are renamed into place only once whole.
  bool adopt_existing = false;
  unsigned files_in_flight = 64;
  // Members at least this large are written O_DIRECT where the destination supports it
  // (statx reports its alignment): from the read blocks or write slots straight to the
  // disk, no copy into the page cache and no dirty pages left to write back. The last
  // partial page of each goes through the page cache. 0: everything buffered.
  uint64_t direct_write_min = 64u << 10;
  uint64_t chunk_size = 4u << 20;  // digest chunk
  size_t slot_size = 1u << 20;     // bytes per write (data copied into slots)
  unsigned slots = 96;
  size_t read_block_size = 8u << 20;  // lent read blocks (see lend()); rounded to 4 KiB
  unsigned read_blocks = 16;
  // Compressed archives: the decoder thread hands its output to the parser in chunks of
  // this size, at most decoded_chunks of them ahead. Small enough for the chunk to be
  // read while still in cache; larger chunks cost more than the handovers they save.
  size_t decoded_chunk = 256u << 10;
  unsigned decoded_chunks = 16;
};

struct ExtractedFile {
  std::string path;
  uint64_t size = 0;
  uint32_t mode = 0;
  int64_t mtime_ns = 0;
  std::vector<uint64_t> digests;  // one per chunk_size of content (one for an empty file)
  bool adopted = false;           // already on disk from an interrupted run (adopt_existing)
};

// An archive file the job reads itself (read_source()).
struct SourceFile {
  int fd = -1;         // buffered reads (and the page-cache residency asked of it)
  int direct_fd = -1;  // the same file opened O_DIRECT, for uncached blocks; -1: none
  uint64_t size = 0;   // the file's size when staging began: shorter is kSourceChanged
  unsigned depth = 8;  // read blocks in flight
  size_t stripe = 0;   // buffered blocks read in stripes of this size, each in flight; 0: whole
  unsigned tick_ms = 100;  // tick() at most this often (and once after the first block)
  // The archive's path: the engine rule (io::resolve_kind) picks the reads' backend for
  // the file system under it, from the backend the job was asked for (a network or FUSE
  // file system: the pread pool). Empty: the reads run on the job's own backend.
  std::string where;
  // A published checksum's hasher: called with every block's bytes, in file order, on a
  // thread of the job's own while the block is fed (and the next ones read); a block
  // is not given back to the job (reused) before it is hashed. With a hasher nothing is
  // seeked over. What it throws stops the reading and is rethrown.
  std::function<void(const char* data, size_t n)> hash;
  unsigned hash_lag = 4;  // blocks the hasher may be behind the feeding before it waits
};

// What read_source() read: bytes and blocks (skipped members' data is not read), and
// how many blocks were read O_DIRECT; the time spent waiting for reads (the writes'
// completions reaped meanwhile) and in feeding the blocks to the parser and writers.
struct SourceReads {
  uint64_t bytes = 0;
  uint64_t blocks = 0;
  uint64_t direct_blocks = 0;
  uint64_t wait_ns = 0;
  uint64_t feed_ns = 0;
  uint64_t hash_wait_ns = 0;  // the feeding waiting for the hasher to catch up
  std::string engine;         // the reads' backend ("uring" or "pread")
};

struct ExtractedLink {
  std::string path;
  std::string target;
  bool hard = false;
};

class ExtractJob {
 public:
  // dst: an existing directory. name: how errors name the archive.
  ExtractJob(std::string dst, std::string name, ExtractOptions options);
  ~ExtractJob();
  ExtractJob(const ExtractJob&) = delete;
  ExtractJob& operator=(const ExtractJob&) = delete;

  // Feeds the next bytes of the (compressed) archive; they are not used after the call.
  // A compressed archive is decoded on a thread of the job's own while the caller's
  // thread parses and writes. Blocks while writes are pending beyond the buffer budget.
  // Throws fastload::Error; after a throw the job is dead, its decoder thread stopped
  // and its temporaries removed.
  void feed(const char* data, size_t n);
  // Read blocks. lend(): a free block's index, or -1 when every block is still being
  // read, parsed or written from (with wait, reaps writes until one is free instead).
  // block(b) is read_block_size bytes, page-aligned (fit for O_DIRECT reads), writable
  // by the caller until feed_block(b, n) (which feeds its first n bytes, like feed()) or
  // release(b). The caller releases each block once it no longer reads it; the job
  // reuses it once its writes are done.
  int lend(bool wait);
  char* block(int b) const;
  size_t block_size() const;
  // The memory behind every block: outlives the job while a holder keeps it.
  std::shared_ptr<char[]> block_storage() const;
  void feed_block(int b, size_t n);
  void release(int b);
  // The archive mapped instead (uncompressed only): map_source() maps fd's first size
  // bytes (fd may be closed afterwards); feed_mapped(offset, n) feeds that range, like
  // feed(), and members are written straight from the mapping, with no read into a
  // buffer: for an archive in the page cache, its pages are the write's source.
  // populate() (any thread, ahead of feed_mapped) maps a range in, reading what is not
  // cached. A file found shorter than mapped throws Error(kSourceChanged).
  void map_source(int fd, uint64_t size);
  void populate(uint64_t offset, uint64_t n) const;
  void feed_mapped(uint64_t offset, size_t n);
  // The archive read by the job itself (issue 33): the whole file, in the job's read
  // blocks, `depth` of them in flight on an engine of the backend the rule gives
  // `source.where` (io::ReadAhead: O_DIRECT for blocks not in the page cache), each fed
  // as it arrives (and hashed, with `source.hash`), skipped members' data seeked over
  // (none with a hasher). tick(offset of the bytes fed so far)
  // runs on this thread between blocks and between waits, while the job is between
  // feeds (it may take_done(), take_warnings(), ...); what it throws stops the reading
  // and is rethrown. Call finish() afterwards. Throws like feed(), and Error(kOs) or
  // Error(kSourceChanged) naming the archive for a failed or short read.
  SourceReads read_source(const SourceFile& source,
                          const std::function<void(uint64_t offset)>& tick);
  // The archive ended: waits for every write, creates hard links, sets directory
  // modes and times. Throws like feed().
  void finish();
  // Bytes of raw archive the caller may seek over instead of feeding (a skipped member's
  // data, uncompressed archives only), and the report that it did.
  uint64_t skippable() const;
  void skipped(uint64_t n);
  // From any thread: makes feed()/finish() stop with Error(kCancelled).
  void cancel() { cancelled_.store(true, std::memory_order_release); }
  // Drops the job's temporaries after an error or cancel (also done by the destructor).
  void abort() noexcept;

  std::vector<ExtractedFile> take_done();
  // Output paths of members skipped because they were already complete (options.complete).
  std::vector<std::string> take_reused();
  // Where GNU tar warns and goes on (a lone zero block, trailing garbage, an unknown
  // type extracted as a file, ...): one line each, naming the archive and the offset or
  // member, in archive order, since the last call. From the feeding thread.
  std::vector<std::string> take_warnings();
  std::vector<ExtractedLink> links() const;
  std::vector<std::string> dirs() const;
  uint64_t bytes_in() const { return bytes_in_.load(std::memory_order_relaxed); }
  uint64_t bytes_out() const { return bytes_out_.load(std::memory_order_relaxed); }
  // Of bytes_out, those written O_DIRECT.
  uint64_t bytes_direct() const { return bytes_direct_.load(std::memory_order_relaxed); }
  uint64_t files_done() const { return files_done_.load(std::memory_order_relaxed); }
  uint64_t files_skipped() const { return files_skipped_; }
  std::string engine_name() const;
  // What the job decodes (kNone: it is fed tar bytes).
  Compression compression() const;

  struct Impl;

 private:
  void feed_from(const char* data, size_t n, int block);
  std::unique_ptr<Impl> impl_;
  std::atomic<bool> cancelled_{false};
  std::atomic<uint64_t> bytes_in_{0};
  std::atomic<uint64_t> bytes_out_{0};
  std::atomic<uint64_t> bytes_direct_{0};
  std::atomic<uint64_t> files_done_{0};
  uint64_t files_skipped_ = 0;
  friend struct Impl;
};

}  // namespace fastload::copy
