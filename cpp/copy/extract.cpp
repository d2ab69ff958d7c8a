// The extraction job: set-up, the ways the archive's bytes come in (the caller's
// buffers, lent read blocks, the mapped archive, a decoder thread's output), finish,
// cancel and the results. Members' files: extract_write.cpp; the tar stream and the
// tree: extract_tree.cpp; the shared state: extract_impl.hpp.
#include "copy/extract.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string_view>

#include "copy/extract_impl.hpp"

namespace fastload::copy {
namespace {

// The process umask, without changing it (umask(2) can only set): from /proc, else the
// usual 022 (which at worst costs an fchmod per file).
uint32_t read_umask() {
  UniqueFd fd(::open("/proc/self/status", O_RDONLY | O_CLOEXEC));
  if (!fd) return 022;
  char buf[4096];
  ssize_t n = ::read(fd.get(), buf, sizeof buf - 1);
  if (n <= 0) return 022;
  buf[n] = 0;
  const char* p = std::strstr(buf, "\nUmask:");
  if (!p) return 022;
  return uint32_t(std::strtoul(p + 8, nullptr, 8)) & 0777;
}

}  // namespace

ExtractJob::Impl::Impl(ExtractJob& j, std::string d, std::string n, ExtractOptions o)
    : job(j), dst(std::move(d)), name(std::move(n)), opt(std::move(o)) {
  opt.slot_size = std::max<size_t>(opt.slot_size, kBlockAlign);
  opt.slot_size -= opt.slot_size % kBlockAlign;  // every slot page-aligned
  opt.slots = std::max(2u, opt.slots);
  opt.files_in_flight = std::max(1u, opt.files_in_flight);
  opt.chunk_size = std::max<uint64_t>(opt.chunk_size, 4096);
  root = std::make_shared<UniqueFd>(::open(dst.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!*root) throw Error::os(errno, "open directory", dst);
  umask_bits = read_umask();
  // FASTLOAD_TMPFILE=0: named temporaries even where O_TMPFILE works (tests run both).
  if (const char* v = std::getenv("FASTLOAD_TMPFILE"); v && std::string_view(v) == "0")
    tmpfile_ok = false;
  init_direct_writes();
  // A multiple of the alignment, so every block of the arena starts aligned.
  opt.read_block_size = std::max<size_t>(opt.read_block_size, kBlockAlign);
  opt.read_block_size -= opt.read_block_size % kBlockAlign;
  opt.read_blocks = std::max(1u, opt.read_blocks);
  uint32_t n_pieces = opt.slots + 4 * opt.files_in_flight;
  io::EngineOptions eo = opt.engine;
  eo.depth = std::max(eo.depth, 2 * opt.files_in_flight + n_pieces + 8);
  int err = 0;
  eng = io::make_engine(eo, &err);
  if (!eng) throw Error::os(-err, "start the I/O engine", "");
  if (auto dec = make_decompressor(opt.compression, name))
    decoder = std::make_unique<DecompressThread>(std::move(dec), opt.decoded_chunk,
                                                 opt.decoded_chunks);
  for (uint32_t s = opt.slots; s-- > 0;) free_slots.push_back(s);
  pieces.resize(n_pieces);
  for (uint32_t k = n_pieces; k-- > 0;) free_pieces.push_back(k);
  // Page-aligned, so the reader may fill them with O_DIRECT reads.
  blocks = aligned_buffer(size_t(opt.read_blocks) * opt.read_block_size);
  block_pins.assign(opt.read_blocks, 0);
  block_lent.assign(opt.read_blocks, false);
  for (uint32_t b = opt.read_blocks; b-- > 0;) free_blocks.push_back(b);
  files.resize(opt.files_in_flight);
  for (uint32_t i = opt.files_in_flight; i-- > 0;) free_files.push_back(i);
  outer = std::make_unique<Level>(*this, "", name, false);
  engine_name = eng->name();
}

ExtractJob::Impl::~Impl() { abort(); }

// Direct writes where the destination's filesystem reports the alignment they need
// (ext4, XFS, btrfs; not tmpfs or network filesystems) and it divides the page and our
// buffers' alignment.
void ExtractJob::Impl::init_direct_writes() {
  page_size = size_t(::sysconf(_SC_PAGESIZE));
  if (opt.direct_write_min == 0) return;
#ifdef STATX_DIOALIGN
  // Filesystems report it for regular files only: asked of an unnamed one.
  UniqueFd probe(::openat(root->get(), ".", O_TMPFILE | O_WRONLY | O_CLOEXEC, 0600));
  struct statx sx;
  if (!probe || ::statx(probe.get(), "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) != 0 ||
      !(sx.stx_mask & STATX_DIOALIGN) || sx.stx_dio_mem_align == 0 ||
      sx.stx_dio_offset_align == 0 || page_size % sx.stx_dio_offset_align != 0 ||
      kBlockAlign % sx.stx_dio_mem_align != 0 || page_size > kBlockAlign)
    return;
  dio_mem_align = sx.stx_dio_mem_align;
  dio_offset_align = sx.stx_dio_offset_align;
  direct_writes = true;
#endif
}

// The decoder thread's output goes to the outer tar parser.
Output ExtractJob::Impl::parse_output() {
  return [this](const char* p, size_t n) { outer->parser.feed(p, n, *outer); };
}

ExtractJob::ExtractJob(std::string dst, std::string name, ExtractOptions options) {
  impl_ = std::make_unique<Impl>(*this, std::move(dst), std::move(name), std::move(options));
}

ExtractJob::~ExtractJob() = default;

void ExtractJob::feed(const char* data, size_t n) { feed_from(data, n, -1); }

void ExtractJob::feed_from(const char* data, size_t n, int block) {
  Impl& im = *impl_;
  if (im.dead) throw Error(ErrorKind::kCancelled, 0, "extraction already failed", im.name);
  try {
    bytes_in_.fetch_add(n, std::memory_order_relaxed);
    if (im.decoder) {
      im.decoder->feed(data, n, im.parse_output(), im.poll());
    } else if (block == Impl::kFeedMapped) {
      // Data anywhere in the mapping is written from where it lies. Parsing reads the
      // mapping: a SIGBUS there (the archive shrank) throws, and the job is dead.
      im.lent_lo = im.mapped->data();
      im.lent_hi = im.lent_lo + im.mapped->size();
      im.mapped->guard([&] { im.outer->parser.feed(data, n, *im.outer); });
      im.unlend();
    } else {
      if (block >= 0) {
        im.lent_block = uint32_t(block);
        im.lent_lo = data;
        im.lent_hi = data + n;
      }
      im.outer->parser.feed(data, n, *im.outer);
      im.unlend();
    }
    im.pump(false);
  } catch (...) {
    im.unlend();
    im.dead = true;
    im.abort();
    throw;
  }
}

int ExtractJob::lend(bool wait) {
  Impl& im = *impl_;
  if (im.dead) throw Error(ErrorKind::kCancelled, 0, "extraction already failed", im.name);
  try {
    im.pump(false);
    while (im.free_blocks.empty()) {
      if (!wait) return -1;
      if (im.eng->in_flight() == 0)
        throw std::logic_error("ExtractJob::lend: every read block is lent and none released");
      im.pump(true);
    }
  } catch (const Error&) {
    im.dead = true;
    im.abort();
    throw;
  }
  uint32_t b = im.free_blocks.back();
  im.free_blocks.pop_back();
  im.block_pins[b] = 1;
  im.block_lent[b] = true;
  return int(b);
}

char* ExtractJob::block(int b) const {
  impl_->check_lent(b);
  return impl_->blocks.get() + size_t(b) * impl_->opt.read_block_size;
}

size_t ExtractJob::block_size() const { return impl_->opt.read_block_size; }

std::shared_ptr<char[]> ExtractJob::block_storage() const { return impl_->blocks; }

void ExtractJob::feed_block(int b, size_t n) {
  impl_->check_lent(b);
  if (n > impl_->opt.read_block_size) throw std::out_of_range("ExtractJob::feed_block: n > block size");
  feed_from(impl_->blocks.get() + size_t(b) * impl_->opt.read_block_size, n, b);
}

void ExtractJob::map_source(int fd, uint64_t size) {
  Impl& im = *impl_;
  if (im.opt.compression != Compression::kNone)
    throw std::logic_error("ExtractJob::map_source: the archive is compressed");
  if (im.mapped) throw std::logic_error("ExtractJob::map_source: already mapped");
  im.mapped = std::make_unique<io::MappedFile>(fd, size, im.name);
}

const io::MappedFile& ExtractJob::Impl::mapping() const {
  if (!mapped) throw std::logic_error("ExtractJob: the archive is not mapped (map_source)");
  return *mapped;
}

void ExtractJob::populate(uint64_t offset, uint64_t n) const { impl_->mapping().populate(offset, n); }

void ExtractJob::feed_mapped(uint64_t offset, size_t n) {
  Impl& im = *impl_;
  const io::MappedFile& m = im.mapping();
  if (offset > m.size() || n > m.size() - offset)
    throw std::out_of_range("ExtractJob::feed_mapped: past the end of the archive");
  feed_from(m.data() + offset, n, Impl::kFeedMapped);
  // Pages well behind are taken out of the process (the page cache keeps them): the
  // mapping adds little to the resident size, whatever the archive's.
  uint64_t behind = offset > Impl::kMappedLag ? offset - Impl::kMappedLag : 0;
  if (behind > im.mapped_released + Impl::kMappedLag) {
    m.release(im.mapped_released, behind - im.mapped_released);
    im.mapped_released = behind;
  }
}

void ExtractJob::release(int b) {
  Impl& im = *impl_;
  im.check_lent(b);
  im.block_lent[size_t(b)] = false;
  im.unpin(uint32_t(b));
}

void ExtractJob::finish() {
  Impl& im = *impl_;
  if (im.dead) throw Error(ErrorKind::kCancelled, 0, "extraction already failed", im.name);
  try {
    if (im.decoder) im.decoder->finish(im.parse_output(), im.poll());
    im.outer->parser.finish(*im.outer);
    while (im.active > 0) im.pump(true);
    im.make_hardlinks();
    im.set_dir_metadata();
    im.abort();  // nothing in flight: just releases the engine and directories
  } catch (...) {
    im.dead = true;
    im.abort();
    throw;
  }
}

uint64_t ExtractJob::skippable() const {
  if (impl_->opt.compression != Compression::kNone || impl_->dead) return 0;
  return impl_->outer->parser.skippable();
}

void ExtractJob::skipped(uint64_t n) {
  bytes_in_.fetch_add(n, std::memory_order_relaxed);
  impl_->outer->parser.skipped(n, *impl_->outer);
}

void ExtractJob::abort() noexcept {
  impl_->dead = true;
  impl_->abort();
}

std::vector<ExtractedFile> ExtractJob::take_done() { return std::exchange(impl_->done, {}); }

std::vector<std::string> ExtractJob::take_reused() { return std::exchange(impl_->reused, {}); }

std::vector<std::string> ExtractJob::take_warnings() {
  Impl& im = *impl_;
  if (im.warnings_dropped) {
    im.warnings.push_back("tar '" + im.name + "': " + std::to_string(im.warnings_dropped) +
                          " more warnings not shown");
    im.warnings_dropped = 0;
  }
  return std::exchange(im.warnings, {});
}

std::vector<ExtractedLink> ExtractJob::links() const { return impl_->links; }

std::vector<std::string> ExtractJob::dirs() const {
  std::vector<std::string> out(impl_->dirs_made.begin(), impl_->dirs_made.end());
  std::sort(out.begin(), out.end());
  return out;
}

std::string ExtractJob::engine_name() const { return impl_->engine_name; }

Compression ExtractJob::compression() const { return impl_->opt.compression; }

}  // namespace fastload::copy
