#include "index/reader.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <ctime>
#include <stdexcept>

#include "common/error.hpp"
#include "io/engine.hpp"

namespace fastload::index {
namespace {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kMaxRead = uint64_t(1) << 30;  // one engine op reads at most this much

std::atomic<uint64_t> g_tables_checksummed{0};  // relaxed: a statistic, orders nothing

std::string folder_of(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

int64_t mtime_ns_of(const struct stat& st) {
  return int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

// A modification time as a person reads it: "2026-11-28 09:02:11.123456789 UTC".
std::string utc_time(int64_t ns) {
  time_t sec = time_t(ns / 1000000000);
  int64_t frac = ns % 1000000000;
  if (frac < 0) {
    frac += 1000000000;
    --sec;
  }
  struct tm tm {};
  char day[32] = "?";
  if (::gmtime_r(&sec, &tm) != nullptr) ::strftime(day, sizeof day, "%Y-%m-%d %H:%M:%S", &tm);
  char out[64];
  std::snprintf(out, sizeof out, "%s.%09lld UTC", day, static_cast<long long>(frac));
  return out;
}

[[noreturn]] void stale(const IndexFile& index, const std::string& detail, int err = 0) {
  throw Error(ErrorKind::kIndexFormat, err, "stale index", index.path(),
              detail +
                  "; rebuild it (ShardIndex.open(path, rebuild=True) or `fastload index`)");
}

}  // namespace

// --- Mapping ---------------------------------------------------------------------------

Mapping::Mapping(int fd, uint64_t size, const std::string& path) : size_(size) {
  if (size == 0) return;
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw Error::os(errno, "mmap", path);
  data_ = static_cast<const char*>(p);
}

Mapping::~Mapping() {
  if (data_) ::munmap(const_cast<char*>(data_), size_);
}

// --- IndexFile -------------------------------------------------------------------------

void IndexFile::corrupt(const std::string& what) const {
  throw Error(ErrorKind::kIndexFormat, 0, "corrupt index", path_, what);
}

std::shared_ptr<const IndexFile> IndexFile::open(const std::string& path) {
  std::shared_ptr<IndexFile> f(new IndexFile());
  f->path_ = path;
  f->folder_ = folder_of(path);
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw Error::os(errno, "open index", path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) throw Error::os(errno, "stat index", path);
  if (!S_ISREG(st.st_mode))
    throw Error(ErrorKind::kIndexFormat, 0, "not an index", path, "not a regular file");
  const uint64_t size = uint64_t(st.st_size);
  f->map_ = std::make_unique<Mapping>(fd.get(), size, path);
  const char* base = f->map_->data();

  if (size < sizeof kMagic || std::memcmp(base, kMagic, sizeof kMagic) != 0)
    throw Error(ErrorKind::kIndexFormat, 0, "not a fastload index", path,
                "bad magic bytes (expected a .fidx file written by fastload)");
  if (size < sizeof(Header))
    f->corrupt("truncated: " + std::to_string(size) + " bytes, shorter than the header");
  Header& h = f->header_;
  std::memcpy(&h, base, sizeof h);
  if (h.version != kVersion)
    throw Error(ErrorKind::kIndexFormat, 0, "unsupported index", path,
                "format version " + std::to_string(h.version) + " (this fastload reads version " +
                    std::to_string(kVersion) + "); rebuild it with this version");
  if (hash::fl64(base, offsetof(Header, header_checksum), kChecksumSeed) != h.header_checksum)
    f->corrupt("header checksum mismatch");
  if (h.header_size != sizeof(Header))
    f->corrupt("header size " + std::to_string(h.header_size));
  if (h.flags & ~kKnownFlags) f->corrupt("unknown flags " + std::to_string(h.flags));
  if (size < h.file_size)
    f->corrupt("truncated: " + std::to_string(size) + " of " + std::to_string(h.file_size) +
               " bytes");
  if (size > h.file_size)
    f->corrupt(std::to_string(size - h.file_size) + " unexpected bytes after the end");

  // Tables in order, aligned, inside the file, without overflow.
  uint64_t at = sizeof(Header);
  auto table = [&](uint64_t offset, uint64_t count, uint64_t record, const char* name) {
    uint64_t bytes;
    if (offset % 8 != 0 || offset < at || __builtin_mul_overflow(count, record, &bytes) ||
        offset + bytes < offset || offset + bytes > size)
      f->corrupt(std::string("the ") + name + " table lies outside the file");
    at = offset + bytes;
  };
  table(h.shard_offset, h.shard_count, sizeof(ShardRecord), "shard");
  table(h.sample_offset, h.sample_count, sizeof(SampleRecord), "sample");
  table(h.member_offset, h.member_count, sizeof(MemberRecord), "member");
  table(h.field_offset, h.field_count, sizeof(FieldRecord), "field");
  table(h.hash_offset, h.hash_slots, sizeof(uint64_t), "hash");
  table(h.string_offset, h.string_size, 1, "string");
  if (!std::has_single_bit(h.hash_slots) || h.hash_slots <= h.sample_count)
    f->corrupt("bad hash table size " + std::to_string(h.hash_slots));
  if (h.shard_count > UINT32_MAX) f->corrupt("too many shards");

  g_tables_checksummed.fetch_add(1, std::memory_order_relaxed);
  if (hash::fl64(base + sizeof(Header), size - sizeof(Header), kChecksumSeed) != h.tables_checksum)
    f->corrupt("table checksum mismatch (the file was modified or damaged)");
  return f;
}

uint64_t IndexFile::tables_checksummed() noexcept {
  return g_tables_checksummed.load(std::memory_order_relaxed);
}

std::string_view IndexFile::str(uint64_t offset, uint64_t length, const char* what) const {
  if (offset > header_.string_size || length > header_.string_size - offset)
    corrupt(std::string("a ") + what + " lies outside the string table");
  return {map_->data() + header_.string_offset + offset, size_t(length)};
}

ShardRecord IndexFile::shard(uint64_t i) const {
  if (i >= header_.shard_count) throw std::out_of_range("shard index out of range");
  auto r = load<ShardRecord>(map_->data() + header_.shard_offset + i * sizeof(ShardRecord));
  if (r.first_sample > header_.sample_count ||
      r.sample_count > header_.sample_count - r.first_sample)
    corrupt("shard " + std::to_string(i) + " refers to samples outside the sample table");
  return r;
}

SampleRecord IndexFile::sample(uint64_t i) const {
  if (i >= header_.sample_count) throw std::out_of_range("sample index out of range");
  auto r = load<SampleRecord>(map_->data() + header_.sample_offset + i * sizeof(SampleRecord));
  if (r.shard >= header_.shard_count || r.first_member > header_.member_count ||
      r.member_count > header_.member_count - r.first_member)
    corrupt("sample " + std::to_string(i) + " refers outside the shard or member table");
  return r;
}

MemberRecord IndexFile::member(uint64_t i) const {
  if (i >= header_.member_count) throw std::out_of_range("member index out of range");
  auto r = load<MemberRecord>(map_->data() + header_.member_offset + i * sizeof(MemberRecord));
  if (r.field >= header_.field_count)
    corrupt("member " + std::to_string(i) + " has an unknown field id");
  return r;
}

std::string_view IndexFile::shard_path(uint64_t i) const {
  ShardRecord r = shard(i);
  return str(r.path_offset, r.path_length, "shard path");
}

std::string IndexFile::shard_open_path(uint64_t i) const {
  std::string_view p = shard_path(i);
  if (!p.empty() && p[0] == '/') return std::string(p);
  if (folder_ == ".") return std::string(p);
  return folder_ + (folder_.back() == '/' ? "" : "/") + std::string(p);
}

std::string_view IndexFile::key(uint64_t sample_index) const {
  SampleRecord r = sample(sample_index);
  return str(r.key_offset, r.key_length, "sample key");
}

std::string_view IndexFile::field_name(uint64_t field) const {
  if (field >= header_.field_count) throw std::out_of_range("field index out of range");
  auto r = load<FieldRecord>(map_->data() + header_.field_offset + field * sizeof(FieldRecord));
  return str(r.name_offset, r.name_length, "field name");
}

std::optional<uint32_t> IndexFile::field_id(std::string_view name) const {
  for (uint64_t f = 0; f < field_count(); ++f)
    if (field_name(f) == name) return uint32_t(f);
  return std::nullopt;
}

std::optional<uint64_t> IndexFile::find(std::string_view k) const {
  const uint64_t mask = header_.hash_slots - 1;
  const char* slots = map_->data() + header_.hash_offset;
  uint64_t h = key_hash(k) & mask;
  for (uint64_t probes = 0; probes < header_.hash_slots; ++probes, h = (h + 1) & mask) {
    uint64_t v = load<uint64_t>(slots + h * sizeof(uint64_t));
    if (v == 0) return std::nullopt;
    if (v > header_.sample_count) corrupt("a hash slot refers outside the sample table");
    if (key(v - 1) == k) return v - 1;
  }
  return std::nullopt;
}

void IndexFile::check_shards() const {
  for (uint64_t i = 0; i < header_.shard_count; ++i) {
    ShardRecord r = shard(i);
    std::string p = shard_open_path(i);
    struct stat st;
    if (::stat(p.c_str(), &st) != 0) {
      int err = errno;
      stale(*this, "shard '" + p + "' cannot be found: " + std::strerror(err), err);
    }
    if (uint64_t(st.st_size) != r.size)
      stale(*this, "shard '" + p + "' changed since it was indexed: size " +
                       std::to_string(st.st_size) + ", was " + std::to_string(r.size));
    if (mtime_ns_of(st) != r.mtime_ns)
      stale(*this, "shard '" + p + "' changed since it was indexed: modified " +
                       utc_time(mtime_ns_of(st)) + ", indexed when modified " +
                       utc_time(r.mtime_ns));
  }
}

// --- Shards ----------------------------------------------------------------------------

Shards::Shards(std::shared_ptr<const IndexFile> index) : index_(std::move(index)) {
  const uint64_t n = index_->shard_count();
  maps_.resize(n);
  fds_.resize(n);
  shard_size_.resize(n);
  for (uint64_t i = 0; i < n; ++i) shard_size_[i] = index_->shard(i).size;
}

Shards::~Shards() {
  // After fork() the parent's engine threads do not exist here: joining them would hang
  // and its ring belongs to the parent. Leak it (the child is short-lived or execs).
  if (engine_ && engine_pid_ != ::getpid()) (void)engine_.release();
}

void Shards::plan(std::span<const uint64_t> samples, const std::vector<bool>* want,
                  std::vector<Piece>& out) const {
  const IndexFile& ix = *index_;
  for (size_t k = 0; k < samples.size(); ++k) {
    SampleRecord s = ix.sample(samples[k]);
    const uint64_t limit = shard_size_[s.shard];
    for (uint32_t m = 0; m < s.member_count; ++m) {
      MemberRecord r = ix.member(s.first_member + m);
      if (want && !(*want)[r.field]) continue;
      if (r.offset > limit || r.size > limit - r.offset)
        throw Error(ErrorKind::kIndexFormat, 0, "corrupt index", ix.path(),
                    "a member of sample '" + std::string(ix.key(samples[k])) +
                        "' lies past the end of its shard");
      out.push_back({uint32_t(k), r.field, s.shard, r.offset, r.size});
    }
  }
}

std::shared_ptr<const Mapping> Shards::mapping(uint32_t shard) {
  std::lock_guard lock(map_mu_);
  auto& slot = maps_.at(shard);
  if (slot) return slot;
  std::string p = index_->shard_open_path(shard);
  UniqueFd fd(::open(p.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw Error::os(errno, "open shard", p);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) throw Error::os(errno, "stat shard", p);
  if (uint64_t(st.st_size) != shard_size_[shard])
    stale(*index_, "shard '" + p + "' changed since it was indexed: size " +
                       std::to_string(st.st_size) + ", was " + std::to_string(shard_size_[shard]));
  auto m = std::make_shared<const Mapping>(fd.get(), shard_size_[shard], p);
  // Samples are read at random: readahead around a fault would mostly read other
  // samples. prefault() asks for exactly the pages of each member instead.
  if (m->size()) ::madvise(const_cast<char*>(m->data()), m->size(), MADV_RANDOM);
  slot = m;
  return slot;
}

void Shards::forget(uint32_t shard) {
  std::shared_ptr<const Mapping> dropped;  // unmapped outside the lock
  {
    std::lock_guard lock(map_mu_);
    dropped = std::move(maps_.at(shard));
  }
  std::lock_guard lock(read_mu_);
  if (fds_.at(shard)) {
    fds_[shard].reset();
    --open_fds_;
  }
}

void Shards::prefault(std::span<const Piece> pieces) {
  uint32_t last_shard = UINT32_MAX;
  std::shared_ptr<const Mapping> held;  // kept here: forget() may drop maps_'s meanwhile
  const char* base = nullptr;
  volatile char sink = 0;
  for (const Piece& p : pieces) {
    if (p.size == 0) continue;
    if (p.shard != last_shard) {
      held = mapping(p.shard);
      base = held->data();
      last_shard = p.shard;
    }
    uint64_t first = p.offset & ~(kPage - 1);
    uint64_t end = p.offset + p.size;
    if (end - first > kPage)  // more than one page: one readahead request for all of them
      ::madvise(const_cast<char*>(base) + first, end - first, MADV_WILLNEED);
    for (uint64_t at = std::max(first, p.offset); at < end; at = (at & ~(kPage - 1)) + kPage)
      sink = sink + base[at];
  }
  (void)sink;
}

int Shards::shard_fd(uint32_t shard, std::span<const Piece> keep) {
  if (fds_[shard]) return fds_[shard].get();
  std::string p = index_->shard_open_path(shard);
  int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 && (errno == EMFILE || errno == ENFILE)) {
    // Out of descriptors: keep only those this batch uses (no read is in flight yet).
    std::vector<bool> needed(fds_.size(), false);
    for (const Piece& piece : keep) needed[piece.shard] = true;
    for (size_t i = 0; i < fds_.size(); ++i)
      if (fds_[i] && !needed[i]) {
        fds_[i].reset();
        --open_fds_;
      }
    fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  }
  if (fd < 0) throw Error::os(errno, "open shard", p);
  UniqueFd owned(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) throw Error::os(errno, "stat shard", p);
  if (uint64_t(st.st_size) != shard_size_[shard])
    stale(*index_, "shard '" + p + "' changed since it was indexed: size " +
                       std::to_string(st.st_size) + ", was " + std::to_string(shard_size_[shard]));
  fds_[shard] = std::move(owned);
  ++open_fds_;
  return fd;
}

void Shards::read(std::span<const Piece> pieces, std::span<char* const> dst) {
  std::lock_guard lock(read_mu_);
  const pid_t pid = ::getpid();
  if (engine_ && engine_pid_ != pid) (void)engine_.release();  // see ~Shards()
  if (!engine_) {
    io::EngineOptions eo;
    eo.depth = 64;
    eo.threads = 8;
    int err = 0;
    engine_ = io::make_engine(eo, &err);
    if (!engine_) throw Error::os(-err, "start the I/O engine for", index_->path());
    engine_pid_ = pid;
  }
  std::vector<int> fd(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) fd[i] = shard_fd(pieces[i].shard, pieces);

  // Each op reads [done, done + len) of one piece; a short read is resubmitted for the
  // rest. Ops are identified by their piece; at most one op per piece is in flight.
  std::vector<uint64_t> done(pieces.size(), 0);
  size_t next = 0;  // next piece not yet started
  std::vector<io::Completion> cq(64);
  int first_err = 0;
  size_t err_piece = 0;
  bool short_file = false;
  auto push_piece = [&](size_t i) {
    uint64_t len = std::min(pieces[i].size - done[i], kMaxRead);
    io::Op op;
    op.code = io::OpCode::kRead;
    op.fd = fd[i];
    op.buf = dst[i] + done[i];
    op.len = uint32_t(len);
    op.offset = pieces[i].offset + done[i];
    op.user_data = i;
    return engine_->push(op);
  };
  for (;;) {
    while (first_err == 0 && !short_file && next < pieces.size() &&
           engine_->in_flight() < engine_->capacity()) {
      if (pieces[next].size == 0) {
        ++next;
        continue;
      }
      if (push_piece(next) != 0) break;
      ++next;
    }
    if (engine_->in_flight() == 0) break;
    int n = engine_->reap(cq.data(), unsigned(cq.size()), 1, -1);
    if (n < 0) {
      // The engine itself failed; nothing more completes. Drop it: a later batch
      // starts a fresh one.
      (void)engine_.release();
      throw Error::os(-n, "read shards of", index_->path());
    }
    for (int c = 0; c < n; ++c) {
      size_t i = size_t(cq[c].user_data);
      int64_t res = cq[c].res;
      if (res < 0) {
        if (first_err == 0) first_err = int(-res), err_piece = i;
        continue;
      }
      if (res == 0) {
        if (!short_file) short_file = true, err_piece = i;
        continue;
      }
      done[i] += uint64_t(res);
      if (done[i] < pieces[i].size && first_err == 0 && !short_file) {
        // Capacity is free: this op's completion was just reaped.
        if (int rc = push_piece(i); rc != 0) first_err = -rc, err_piece = i;
      }
    }
  }
  if (first_err)
    throw Error::os(first_err, "read shard", index_->shard_open_path(pieces[err_piece].shard));
  if (short_file)
    stale(*index_, "shard '" + index_->shard_open_path(pieces[err_piece].shard) +
                       "' is shorter than when it was indexed");
}

std::string Shards::engine_name() const {
  std::lock_guard lock(read_mu_);
  return engine_ ? engine_->name() : "";
}

}  // namespace fastload::index
