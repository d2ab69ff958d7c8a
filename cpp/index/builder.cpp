#include "index/builder.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <unordered_map>

#include "common/error.hpp"
#include "common/unique_fd.hpp"
#include "index/format.hpp"
#include "tar/reader.hpp"

namespace fastload::index {

// One shard's samples, as its scanning thread found them. Keys live in `arena`, field
// names are numbered per shard and renumbered globally when shards are merged.
struct ScannedSample {
  uint64_t key_offset;
  uint32_t key_length;
  uint32_t first_member;  // into ShardScan::members
  uint32_t member_count;
};

struct ScannedMember {
  uint32_t field;  // into ShardScan::fields
  uint64_t offset;
  uint64_t size;
};

struct ShardScan {
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  std::string arena;
  std::vector<ScannedSample> samples;
  std::vector<ScannedMember> members;
  std::vector<std::string> fields;
  std::exception_ptr error;
};

namespace {

// Compressed tar files are recognised by their magic bytes (not their names, which lie).
const char* compression_of(const unsigned char* p, size_t n) {
  auto starts = [&](std::initializer_list<unsigned char> magic) {
    if (n < magic.size()) return false;
    return std::equal(magic.begin(), magic.end(), p);
  };
  if (starts({0x1f, 0x8b})) return "gzip";
  if (starts({0x28, 0xb5, 0x2f, 0xfd})) return "zstd";
  if (starts({'B', 'Z', 'h'})) return "bzip2";
  if (starts({0xfd, '7', 'z', 'X', 'Z', 0x00})) return "xz";
  if (starts({0x04, 0x22, 0x4d, 0x18})) return "lz4";
  return nullptr;
}

std::string_view normalise(std::string_view path) {
  while (path.size() >= 2 && path[0] == '.' && path[1] == '/') {
    path.remove_prefix(2);
    while (!path.empty() && path[0] == '/') path.remove_prefix(1);
  }
  return path;
}

bool is_metadata(std::string_view path) {
  return path.find('/') == std::string_view::npos && path.size() >= 4 &&
         path.starts_with("__") && path.ends_with("__");
}

void scan_shard(const ShardInput& in, const BuildOptions& opt, ShardScan* out) {
  const std::string& path = in.open_path;
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw Error::os(errno, "open shard", path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) throw Error::os(errno, "stat shard", path);
  if (!S_ISREG(st.st_mode))
    throw Error(ErrorKind::kFormat, 0, "cannot index", path, "not a regular file");
  out->size = uint64_t(st.st_size);
  out->mtime_ns = int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;

  unsigned char head[8] = {};
  ssize_t got = ::pread(fd.get(), head, sizeof head, 0);
  if (got < 0) throw Error::os(errno, "read shard", path);
  if (const char* kind = compression_of(head, size_t(got)))
    throw Error(ErrorKind::kFormat, 0, "cannot index", path,
                std::string(kind) +
                    "-compressed shard: a compressed tar cannot be read at random; "
                    "stage it uncompressed first (`fastload stage`) or decompress it");

  std::unordered_map<std::string, uint32_t> field_ids;
  std::string last_key;
  bool have_sample = false;
  tar::scan_file(fd.get(), out->size, path, [&](const tar::Member& m) {
    if (opt.cancel && opt.cancel->cancelled()) return false;
    if (m.type != tar::MemberType::kFile) return true;
    std::string_view name = normalise(m.path);
    if (is_metadata(name)) return true;
    // A sparse member's bytes are not one range of the shard, so it cannot be served
    // from it: refused (skipping it would drop a field of a sample silently).
    if (m.sparse)
      throw Error(ErrorKind::kFormat, 0, "cannot index", path,
                  "member '" + m.path +
                      "' is a sparse file (GNU tar --sparse): its data is not stored in one "
                      "piece; write the shard without --sparse, or stage it to read the file");
    std::string_view key, field;
    if (!split_key(name, &key, &field))
      throw Error(ErrorKind::kFormat, 0, "cannot index", path,
                  "member '" + m.path +
                      "' has no sample key: webdataset shards name members KEY.FIELD, with "
                      "a non-empty key and field around the first dot of the base name");
    if (!have_sample || key != last_key) {
      if (out->members.size() > UINT32_MAX)
        throw Error(ErrorKind::kFormat, 0, "cannot index", path, "more than 2^32 members");
      out->samples.push_back({out->arena.size(), uint32_t(key.size()),
                              uint32_t(out->members.size()), 0});
      out->arena.append(key);
      last_key.assign(key);
      have_sample = true;
    }
    auto [it, added] = field_ids.try_emplace(std::string(field), uint32_t(out->fields.size()));
    if (added) out->fields.emplace_back(field);
    ScannedSample& s = out->samples.back();
    for (uint32_t i = s.first_member; i < s.first_member + s.member_count; ++i)
      if (out->members[i].field == it->second)
        throw Error(ErrorKind::kFormat, 0, "cannot index", path,
                    "sample '" + last_key + "' has field '" + std::string(field) +
                        "' twice (member '" + m.path + "')");
    out->members.push_back({it->second, m.data_offset, m.size});
    ++s.member_count;
    return true;
  });
  if (opt.cancel && opt.cancel->cancelled())
    throw Error(ErrorKind::kCancelled, 0, "index build cancelled", path);
}

void scan_all(const std::vector<ShardInput>& shards, const BuildOptions& opt,
              std::vector<ShardScan>& scans) {
  unsigned threads = opt.threads;
  if (threads == 0) threads = std::clamp(std::thread::hardware_concurrency(), 1u, 16u);
  threads = unsigned(std::min<size_t>(threads, shards.size()));
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (;;) {
      size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= shards.size()) return;
      if (opt.cancel && opt.cancel->cancelled()) {
        scans[i].error = std::make_exception_ptr(
            Error(ErrorKind::kCancelled, 0, "index build cancelled", shards[i].open_path));
        continue;
      }
      try {
        scan_shard(shards[i], opt, &scans[i]);
      } catch (...) {
        scans[i].error = std::current_exception();
      }
      if (opt.shards_done) opt.shards_done->fetch_add(1, std::memory_order_relaxed);
    }
  };
  if (threads <= 1) {
    work();
  } else {
    std::vector<std::thread> pool;
    pool.reserve(threads - 1);
    for (unsigned t = 0; t + 1 < threads; ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
  }
  // The first failing shard in shard order, so the error does not depend on timing;
  // a cancellation wins over any other error.
  for (auto& s : scans) {
    if (!s.error) continue;
    try {
      std::rethrow_exception(s.error);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::kCancelled) throw;
    } catch (...) {
    }
  }
  for (auto& s : scans)
    if (s.error) std::rethrow_exception(s.error);
}

template <typename T>
void put(std::string& out, uint64_t offset, const T& v) {
  std::memcpy(out.data() + offset, &v, sizeof v);
}

}  // namespace

bool split_key(std::string_view path, std::string_view* key, std::string_view* field) {
  size_t slash = path.rfind('/');
  size_t base = slash == std::string_view::npos ? 0 : slash + 1;
  size_t dot = path.find('.', base);
  if (dot == std::string_view::npos || dot == base || dot + 1 == path.size()) return false;
  *key = path.substr(0, dot);
  *field = path.substr(dot + 1);
  return true;
}

std::shared_ptr<const ShardScan> scan_one(const std::string& path, const BuildOptions& options) {
  auto out = std::make_shared<ShardScan>();
  scan_shard(ShardInput{path, path}, options, out.get());
  return out;
}

namespace {

// The index bytes of the scanned shards; `owned` (the scans, when they are the
// caller's to free) has each scan freed once merged.
std::string assemble(const std::vector<ShardInput>& shards,
                     const std::vector<const ShardScan*>& scans, std::vector<ShardScan>* owned,
                     const BuildOptions& opt, BuildResult* result) {
  if (shards.size() > UINT32_MAX)
    throw Error(ErrorKind::kFormat, 0, "cannot index more than 2^32 shards", "");

  // Merge: global field ids, the string table, samples deduplicated through the hash table.
  uint64_t max_samples = 0, max_members = 0;
  for (const ShardScan* s : scans) {
    max_samples += s->samples.size();
    max_members += s->members.size();
  }
  std::string strings;
  std::vector<ShardRecord> shard_recs(shards.size());
  for (size_t i = 0; i < shards.size(); ++i) {
    shard_recs[i] = {strings.size(), uint32_t(shards[i].stored_path.size()), 0, scans[i]->size,
                     scans[i]->mtime_ns, 0, 0};
    strings += shards[i].stored_path;
  }
  std::vector<FieldRecord> field_recs;
  std::unordered_map<std::string, uint32_t> field_ids;
  std::vector<SampleRecord> samples;
  std::vector<MemberRecord> members;
  samples.reserve(max_samples);
  members.reserve(max_members);
  const uint64_t slots = hash_slots_for(max_samples);
  std::vector<uint64_t> table(slots, 0);
  const uint64_t mask = slots - 1;
  BuildResult r;
  std::vector<uint32_t> remap;
  for (size_t si = 0; si < scans.size(); ++si) {
    const ShardScan& sc = *scans[si];
    remap.resize(sc.fields.size());
    for (size_t f = 0; f < sc.fields.size(); ++f) {
      auto [it, added] = field_ids.try_emplace(sc.fields[f], uint32_t(field_recs.size()));
      if (added) {
        field_recs.push_back({strings.size(), uint32_t(sc.fields[f].size()), 0});
        strings += sc.fields[f];
      }
      remap[f] = it->second;
    }
    shard_recs[si].first_sample = samples.size();
    for (const ScannedSample& s : sc.samples) {
      std::string_view key(sc.arena.data() + s.key_offset, s.key_length);
      uint64_t h = key_hash(key) & mask;
      bool duplicate = false;
      while (table[h] != 0) {
        const SampleRecord& other = samples[table[h] - 1];
        if (std::string_view(strings.data() + other.key_offset, other.key_length) == key) {
          duplicate = true;
          break;
        }
        h = (h + 1) & mask;
      }
      if (duplicate) {
        if (opt.on_duplicate == OnDuplicate::kFirst) {
          ++r.duplicates_skipped;
          continue;
        }
        const SampleRecord& other = samples[table[h] - 1];
        throw Error(ErrorKind::kFormat, 0, "cannot index", shards[si].open_path,
                    "duplicate sample key '" + std::string(key) + "' (also in '" +
                        shards[other.shard].open_path +
                        "'); pass on_duplicate=\"first\" to keep the first");
      }
      table[h] = samples.size() + 1;
      samples.push_back({strings.size(), s.key_length, uint32_t(si), members.size(),
                         s.member_count, 0});
      strings.append(key);
      for (uint32_t m = 0; m < s.member_count; ++m) {
        const ScannedMember& sm = sc.members[s.first_member + m];
        members.push_back({remap[sm.field], 0, sm.offset, sm.size});
      }
    }
    shard_recs[si].sample_count = samples.size() - shard_recs[si].first_sample;
    r.shard_bytes += sc.size;
    // Free each scan of ours as soon as it is merged: peak memory is one copy, not two.
    if (owned) (*owned)[si] = ShardScan();
  }

  Header h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.version = kVersion;
  h.header_size = sizeof(Header);
  h.flags = opt.on_duplicate == OnDuplicate::kFirst ? kFlagFirstOnDuplicate : 0;
  h.shard_count = shard_recs.size();
  h.sample_count = samples.size();
  h.member_count = members.size();
  h.field_count = field_recs.size();
  h.hash_slots = slots;
  uint64_t at = sizeof(Header);
  h.shard_offset = at;
  at = align8(at + shard_recs.size() * sizeof(ShardRecord));
  h.sample_offset = at;
  at = align8(at + samples.size() * sizeof(SampleRecord));
  h.member_offset = at;
  at = align8(at + members.size() * sizeof(MemberRecord));
  h.field_offset = at;
  at = align8(at + field_recs.size() * sizeof(FieldRecord));
  h.hash_offset = at;
  at = align8(at + slots * sizeof(uint64_t));
  h.string_offset = at;
  h.string_size = strings.size();
  h.file_size = at + strings.size();

  std::string out(h.file_size, '\0');
  auto copy_table = [&](uint64_t offset, const void* data, size_t bytes) {
    if (bytes) std::memcpy(out.data() + offset, data, bytes);
  };
  copy_table(h.shard_offset, shard_recs.data(), shard_recs.size() * sizeof(ShardRecord));
  copy_table(h.sample_offset, samples.data(), samples.size() * sizeof(SampleRecord));
  copy_table(h.member_offset, members.data(), members.size() * sizeof(MemberRecord));
  copy_table(h.field_offset, field_recs.data(), field_recs.size() * sizeof(FieldRecord));
  copy_table(h.hash_offset, table.data(), table.size() * sizeof(uint64_t));
  copy_table(h.string_offset, strings.data(), strings.size());
  h.tables_checksum =
      hash::fl64(out.data() + sizeof(Header), out.size() - sizeof(Header), kChecksumSeed);
  h.header_checksum = hash::fl64(&h, offsetof(Header, header_checksum), kChecksumSeed);
  put(out, 0, h);

  r.shards = shard_recs.size();
  r.samples = samples.size();
  r.members = members.size();
  r.fields = field_recs.size();
  r.index_bytes = out.size();
  if (result) *result = r;
  return out;
}

}  // namespace

std::string build_bytes(const std::vector<ShardInput>& shards, const BuildOptions& opt,
                        BuildResult* result) {
  std::vector<ShardScan> scans(shards.size());
  scan_all(shards, opt, scans);
  std::vector<const ShardScan*> each(scans.size());
  for (size_t i = 0; i < scans.size(); ++i) each[i] = &scans[i];
  return assemble(shards, each, &scans, opt, result);
}

std::string build_bytes(const std::vector<ShardInput>& shards,
                        const std::vector<const ShardScan*>& scans, const BuildOptions& opt,
                        BuildResult* result) {
  if (scans.size() != shards.size())
    throw std::invalid_argument("build_bytes: one scan per shard is needed");
  return assemble(shards, scans, nullptr, opt, result);
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  size_t slash = path.rfind('/');
  std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  std::string tmp = (slash == std::string::npos ? "" : path.substr(0, slash + 1)) + "." +
                    base.substr(0, 200) + ".fl-tmp" + std::to_string(::getpid());
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd) throw Error::os(errno, "create index", tmp);
  auto fail = [&](const char* op) {
    int err = errno;
    fd.reset();
    ::unlink(tmp.c_str());
    throw Error::os(err, op, path);
  };
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd.get(), bytes.data() + done, std::min<size_t>(bytes.size() - done, 1 << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("write index");
    }
    done += size_t(n);
  }
  if (::fsync(fd.get()) != 0) fail("fsync index");
  if (::close(fd.release()) != 0) fail("close index");
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename index into place");
  // The rename is durable only once the folder is synced.
  UniqueFd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd) (void)::fsync(dfd.get());
}

BuildResult build(const std::vector<ShardInput>& shards, const std::string& index_path,
                  const BuildOptions& options) {
  BuildResult r;
  std::string bytes = build_bytes(shards, options, &r);
  write_file_atomic(index_path, bytes);
  return r;
}

}  // namespace fastload::index
