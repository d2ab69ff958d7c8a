#include "pack/pack.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <thread>

#include "common/error.hpp"
#include "common/unique_fd.hpp"
#include "common/write.hpp"
#include "tar/reader.hpp"
#include "tar/writer.hpp"

namespace fastload::pack {

using tar::header_bytes;
using tar::kEndBytes;
using tar::member_bytes;
using tar::read_source;
using tar::ShardFile;
using tar::write_header;

namespace {

// Runs body(worker) on n threads (the caller's among them). The first exception stops the
// others (they poll `failed`) and is rethrown once all have returned.
template <class F>
void parallel(unsigned n, F&& body) {
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex mu;
  auto one = [&](unsigned w) {
    try {
      body(w, failed);
    } catch (...) {
      std::lock_guard lock(mu);
      if (!error) error = std::current_exception();
      failed.store(true, std::memory_order_relaxed);
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(n > 0 ? n - 1 : 0);
  try {
    for (unsigned w = 1; w < n; ++w) threads.emplace_back(one, w);
  } catch (...) {
    failed = true;  // could not start a thread: stop the ones that did
    for (auto& t : threads) t.join();
    throw;
  }
  one(0);
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

unsigned thread_count(unsigned asked, size_t work) {
  unsigned n = asked;
  if (n == 0) n = std::min(16u, std::max(1u, std::thread::hardware_concurrency()));
  return unsigned(std::max<size_t>(1, std::min<size_t>(n, work)));
}

void check_cancel(const CancelToken* cancel, const std::string& what) {
  if (cancel && cancel->cancelled()) throw Error(ErrorKind::kCancelled, 0, "pack cancelled", what);
}

}  // namespace

// ---- listing archives ----------------------------------------------------------------

namespace {

class ListSink final : public tar::Sink {
 public:
  explicit ListSink(std::function<void(const tar::Member&)> fn) : fn_(std::move(fn)) {}
  tar::Action on_member(const tar::Member& m) override {
    fn_(m);
    return tar::Action::kSkip;
  }
  void on_data(const char*, size_t) override {}
  void on_member_end() override {}

 private:
  std::function<void(const tar::Member&)> fn_;
};

// Members below this size are read through with the next header (one read serves many
// headers); after a larger one only a header-sized window is read and the data seeked over.
constexpr uint64_t kSmallMember = 16 * 1024;
constexpr size_t kWindow = 64 * 1024;
constexpr size_t kHeaderWindow = 4 * 1024;

// Calls fn for each header of the tar stored at [base, base + len) of fd, in order.
// Member offsets are relative to base.
void scan_range(int fd, uint64_t base, uint64_t len, const std::string& name,
                const CancelToken* cancel, const std::function<void(const tar::Member&)>& fn) {
  tar::StreamParser parser(name);
  uint64_t last = 0;
  ListSink sink([&](const tar::Member& m) {
    last = m.size;
    fn(m);
  });
  std::vector<char> buf(kWindow);
  uint64_t off = 0;
  unsigned since_check = 0;
  while (off < len && !parser.at_end()) {
    if (++since_check == 256) {
      since_check = 0;
      check_cancel(cancel, name);
    }
    if (const uint64_t skip = parser.skippable(); skip > 0) {
      const uint64_t k = std::min(skip, len - off);
      parser.skipped(k, sink);
      off += k;
      continue;
    }
    const size_t want =
        size_t(std::min<uint64_t>(len - off, last < kSmallMember ? kWindow : kHeaderWindow));
    const ssize_t r = ::pread(fd, buf.data(), want, off_t(base + off));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw Error::os(errno, "read", name);
    }
    if (r == 0) throw Error(ErrorKind::kFormat, 0, "read", name, "file ended early (changed while read?)");
    parser.feed(buf.data(), size_t(r), sink);
    off += uint64_t(r);
  }
  if (!parser.at_end()) parser.finish(sink);
}

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

struct Entry {
  Listed member;       // a regular member, or (inner) a member tar
  bool inner = false;  // member.path: the member tar's path without ".tar"
};

}  // namespace

Listing list_archive(const std::string& path, bool nested, unsigned threads,
                     const CancelToken* cancel) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw Error::os(errno, "open", path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) throw Error::os(errno, "stat", path);
  if (!S_ISREG(st.st_mode))
    throw Error(ErrorKind::kUnsupported, 0, "refusing to pack", path, "not a regular file");

  Listing out;
  std::vector<Entry> entries;
  const auto note_skipped = [&out](const tar::Member& m, std::vector<std::string>* examples) {
    if (m.type == tar::MemberType::kDir) return;
    ++out.skipped;
    if (examples->size() < 8) examples->push_back(m.path);
  };
  auto normalise = [](const std::string& archive, const tar::Member& m) {
    std::string rel, why;
    if (!tar::safe_relative_path(m.path, &rel, &why))
      throw Error(ErrorKind::kUnsafe, 0, "refusing archive member", archive + ": " + m.path, why);
    return rel;
  };
  scan_range(fd.get(), 0, uint64_t(st.st_size), path, cancel, [&](const tar::Member& m) {
    // A sparse member's bytes are not one range of the archive: not packed (listed as
    // skipped; stage the archive to get the file).
    if (m.type != tar::MemberType::kFile || m.sparse) return note_skipped(m, &out.skipped_examples);
    std::string rel = normalise(path, m);
    if (rel.empty()) return note_skipped(m, &out.skipped_examples);
    const bool inner = nested && ends_with(rel, ".tar") && rel.size() > 4;
    if (inner) rel.resize(rel.size() - 4);
    entries.push_back({{std::move(rel), m.data_offset, m.size}, inner});
  });

  std::vector<size_t> inner_at;
  for (size_t i = 0; i < entries.size(); ++i)
    if (entries[i].inner) inner_at.push_back(i);
  out.inner_tars = inner_at.size();
  std::vector<std::vector<Listed>> inner(inner_at.size());
  std::vector<uint64_t> inner_skipped(inner_at.size(), 0);
  std::vector<std::vector<std::string>> inner_examples(inner_at.size());
  std::atomic<size_t> next{0};
  parallel(thread_count(threads, inner_at.size()), [&](unsigned, std::atomic<bool>& failed) {
    for (size_t k; !failed.load(std::memory_order_relaxed) && (k = next++) < inner_at.size();) {
      const Listed& t = entries[inner_at[k]].member;
      const std::string name = path + ":" + t.path + ".tar";
      scan_range(fd.get(), t.offset, t.size, name, cancel, [&](const tar::Member& m) {
        if (m.type == tar::MemberType::kDir) return;
        if (m.type != tar::MemberType::kFile || m.sparse) {
          ++inner_skipped[k];
          if (inner_examples[k].size() < 8) inner_examples[k].push_back(t.path + ".tar:" + m.path);
          return;
        }
        std::string rel = normalise(name, m);
        if (rel.empty()) {
          ++inner_skipped[k];
          return;
        }
        inner[k].push_back({t.path + "/" + rel, t.offset + m.data_offset, m.size});
      });
    }
  });
  check_cancel(cancel, path);

  size_t total = entries.size() - inner_at.size();
  for (const auto& v : inner) total += v.size();
  out.members.reserve(total);
  size_t k = 0;
  for (auto& e : entries) {
    if (!e.inner) {
      out.members.push_back(std::move(e.member));
      continue;
    }
    for (auto& m : inner[k]) out.members.push_back(std::move(m));
    out.skipped += inner_skipped[k];
    for (auto& x : inner_examples[k])
      if (out.skipped_examples.size() < 8) out.skipped_examples.push_back(std::move(x));
    ++k;
  }
  return out;
}

// ---- executing a plan ----------------------------------------------------------------

namespace {

constexpr size_t kBatchBytes = 4u << 20;  // kScatter: one source read (per thread)
constexpr uint64_t kBatchGap = 1u << 20;   // read through gaps up to this, seek past larger

void check_plan(const Plan& p) {
  const size_t n = p.m_src.size();
  auto bad = [](const std::string& what) { throw std::invalid_argument("pack plan: " + what); };
  if (p.m_off.size() != n || p.m_size.size() != n || p.m_name.size() != n ||
      p.m_name_len.size() != n || p.m_first.size() != n)
    bad("per-member arrays differ in length");
  if (p.src_offsets.empty()) bad("src_offsets is empty");
  const size_t sources = p.src_offsets.size() - 1;
  for (size_t i = 0; i < sources; ++i)
    if (p.src_offsets[i] > p.src_offsets[i + 1] || p.src_offsets[i + 1] > p.sources.size())
      bad("source offsets out of range");
  if (p.shard_first.empty()) bad("shard_first is empty");
  const size_t shards = p.shard_first.size() - 1;
  if (p.final_paths.size() != shards || p.tmp_paths.size() != shards)
    bad("shard paths do not match shard_first");
  for (size_t s = 0; s < shards; ++s)
    if (p.shard_first[s] > p.shard_first[s + 1] || p.shard_first[s + 1] > n)
      bad("shard_first out of range");
  for (size_t i = 0; i < n; ++i) {
    if (p.m_src[i] < -1 || (p.m_src[i] >= 0 && uint64_t(p.m_src[i]) >= sources))
      bad("member source out of range");
    if (p.m_src[i] < 0 && (p.m_off[i] > p.inline_data.size() ||
                           p.m_size[i] > p.inline_data.size() - p.m_off[i]))
      bad("inline member out of range");
    if (p.m_name[i] > p.names.size() || p.m_name_len[i] > p.names.size() - p.m_name[i] ||
        p.m_name_len[i] == 0)
      bad("member name out of range");
    if (p.m_size[i] > (uint64_t{1} << 62)) bad("member too large");
    if (std::memchr(p.names.data() + p.m_name[i], 0, p.m_name_len[i]))
      bad("member name contains a NUL byte");
  }
}

std::string_view name_of(const Plan& p, size_t m) {
  return p.names.substr(size_t(p.m_name[m]), p.m_name_len[m]);
}

std::string source_name(const Plan& p, int64_t src) {
  const std::string_view rel = p.sources.substr(
      size_t(p.src_offsets[size_t(src)]),
      size_t(p.src_offsets[size_t(src) + 1] - p.src_offsets[size_t(src)]));
  if (p.root.empty()) return std::string(rel);
  return p.root + "/" + std::string(rel);
}

void count(const Plan& p, const Options& o, size_t m) {
  if (o.samples_done && p.m_first[m]) o.samples_done->fetch_add(1, std::memory_order_relaxed);
  if (o.bytes_done) o.bytes_done->fetch_add(p.m_size[m], std::memory_order_relaxed);
}

// Opens source files relative to the root (one descriptor of it, opened once).
class Sources {
 public:
  explicit Sources(const Plan& p) : p_(p) {
    if (!p.root.empty()) {
      root_.reset(::open(p.root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
      if (!root_) throw Error::os(errno, "open directory", p.root);
    }
  }
  UniqueFd open(int64_t src) const {
    const std::string_view rel = p_.sources.substr(
        size_t(p_.src_offsets[size_t(src)]),
        size_t(p_.src_offsets[size_t(src) + 1] - p_.src_offsets[size_t(src)]));
    const std::string r(rel);
    const int fd = root_ ? ::openat(root_.get(), r.c_str(), O_RDONLY | O_CLOEXEC)
                         : ::open(r.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw Error::os(errno, "open", source_name(p_, src));
    return UniqueFd(fd);
  }

 private:
  const Plan& p_;
  UniqueFd root_;
};

void run_per_shard(const Plan& p, const Options& o) {
  const size_t shards = p.shard_first.size() - 1;
  const Sources sources(p);
  std::atomic<size_t> next{0};
  parallel(thread_count(o.threads, shards), [&](unsigned, std::atomic<bool>& failed) {
    for (size_t s; !failed.load(std::memory_order_relaxed) && (s = next++) < shards;) {
      ShardFile f(p.final_paths[s], p.tmp_paths[s]);
      int64_t open_src = -1;
      UniqueFd src_fd;
      for (uint64_t m = p.shard_first[s]; m < p.shard_first[s + 1]; ++m) {
        if (failed.load(std::memory_order_relaxed)) return;  // f's destructor cleans up
        check_cancel(o.cancel, p.final_paths[s]);
        const std::string_view name = name_of(p, size_t(m));
        const int64_t src = p.m_src[size_t(m)];
        if (src < 0) {
          f.add(name, p.inline_data.data() + p.m_off[size_t(m)], p.m_size[size_t(m)]);
        } else {
          if (src != open_src) {
            src_fd = sources.open(src);
            open_src = src;
          }
          f.add_from(name, p.m_size[size_t(m)], src_fd.get(), p.m_off[size_t(m)], p.whole_files,
                     source_name(p, src));
        }
        count(p, o, size_t(m));
      }
      f.commit(o.sync);
    }
  });
}

struct Batch {
  size_t begin, end;  // into the sorted member order
  int64_t src;
  uint64_t off, len;  // the source bytes read for it (0 for inline members)
};

// Shards [s0, s1): created at their final size (so padding and the end marker are the
// zeros ftruncate leaves), every member written at its place by whichever thread read
// it, then synced and renamed.
void run_scatter_window(const Plan& p, const Options& o, size_t s0, size_t s1,
                        const std::vector<uint64_t>& sizes, const Sources& sources,
                        const std::vector<UniqueFd>& src_fds) {
  const size_t nshards = s1 - s0;
  std::vector<UniqueFd> out(nshards);
  std::vector<char> renamed(nshards, 0);  // one byte per shard: written by several threads
  auto cleanup = [&]() noexcept {
    for (size_t k = 0; k < nshards; ++k) {
      out[k].reset();
      if (!renamed[k]) ::unlink(p.tmp_paths[s0 + k].c_str());
    }
  };
  try {
    for (size_t k = 0; k < nshards; ++k) {
      const std::string& tmp = p.tmp_paths[s0 + k];
      out[k].reset(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
      if (!out[k]) throw Error::os(errno, "create", tmp);
      if (::ftruncate(out[k].get(), off_t(sizes[s0 + k])) != 0)
        throw Error::os(errno, "set the size of", p.final_paths[s0 + k]);
    }
    // Where each member goes: its shard and offset there.
    const size_t m0 = size_t(p.shard_first[s0]), m1 = size_t(p.shard_first[s1]);
    std::vector<uint64_t> at(m1 - m0);
    std::vector<uint32_t> shard_of(m1 - m0);
    for (size_t s = s0; s < s1; ++s) {
      uint64_t cur = 0;
      for (uint64_t m = p.shard_first[s]; m < p.shard_first[s + 1]; ++m) {
        at[size_t(m) - m0] = cur;
        shard_of[size_t(m) - m0] = uint32_t(s - s0);
        cur += member_bytes(p.m_name_len[size_t(m)], p.m_size[size_t(m)]);
      }
    }
    // Read order: by source, then offset.
    std::vector<size_t> order(m1 - m0);
    std::iota(order.begin(), order.end(), m0);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return p.m_src[a] != p.m_src[b] ? p.m_src[a] < p.m_src[b] : p.m_off[a] < p.m_off[b];
    });
    std::vector<Batch> batches;
    for (size_t i = 0; i < order.size();) {
      const size_t m = order[i];
      Batch b{i, i + 1, p.m_src[m], p.m_off[m], p.m_size[m]};
      uint64_t end = b.off + b.len;
      while (b.end < order.size()) {
        const size_t q = order[b.end];
        if (p.m_src[q] != b.src) break;
        if (b.src < 0) {
          if (b.end - b.begin >= 4096) break;
        } else {
          const uint64_t qend = std::max(end, p.m_off[q] + p.m_size[q]);
          if (p.m_off[q] > end + kBatchGap || qend - b.off > kBatchBytes) break;
          end = qend;
        }
        ++b.end;
      }
      b.len = b.src < 0 ? 0 : end - b.off;
      batches.push_back(b);
      i = b.end;
    }

    std::atomic<size_t> next{0};
    parallel(thread_count(o.threads, batches.size()), [&](unsigned, std::atomic<bool>& failed) {
      std::vector<char> buf;
      std::string head;
      for (size_t bi; !failed.load(std::memory_order_relaxed) && (bi = next++) < batches.size();) {
        const Batch& b = batches[bi];
        check_cancel(o.cancel, p.final_paths[s0]);
        const bool whole = b.src < 0 || b.len <= kBatchBytes;
        const std::string what = b.src < 0 ? std::string() : source_name(p, b.src);
        // A tree's files are opened as their turn comes (a batch is one file); an
        // archive's descriptor is shared.
        UniqueFd own;
        int src_fd = -1;
        if (b.src >= 0) {
          if (p.whole_files) own = sources.open(b.src);
          src_fd = p.whole_files ? own.get() : src_fds[size_t(b.src)].get();
        }
        if (b.src >= 0 && whole) {
          buf.resize(std::max<size_t>(buf.size(), size_t(b.len) + 1));
          read_source(src_fd, buf.data(), b.len, b.off, p.whole_files, what);
        }
        for (size_t i = b.begin; i < b.end; ++i) {
          const size_t m = order[i];
          const std::string_view name = name_of(p, m);
          const uint64_t size = p.m_size[m];
          head.resize(size_t(header_bytes(name.size(), size)));
          write_header(name, size, head.data());
          const uint32_t k = shard_of[m - m0];
          const int fd = out[k].get();
          const std::string& shard = p.final_paths[s0 + k];
          const uint64_t pos = at[m - m0];
          if (whole) {
            const char* data = b.src < 0 ? p.inline_data.data() + p.m_off[m]
                                         : buf.data() + (p.m_off[m] - b.off);
            iovec iov[2] = {{head.data(), head.size()}, {const_cast<char*>(data), size_t(size)}};
            uint64_t left = head.size() + size, put = 0;
            while (left > 0) {
              // Advance the iovecs past what a short write took.
              iovec v[2];
              int nv = 0;
              uint64_t skip = put;
              for (const iovec& x : iov) {
                if (skip >= x.iov_len) {
                  skip -= x.iov_len;
                  continue;
                }
                v[nv++] = {static_cast<char*>(x.iov_base) + skip, x.iov_len - skip};
                skip = 0;
              }
              const ssize_t r = ::pwritev(fd, v, nv, off_t(pos + put));
              if (r < 0) {
                if (errno == EINTR) continue;
                throw Error::os(errno, "write", shard);
              }
              if (r == 0) throw Error::os(EIO, "write", shard);
              put += uint64_t(r);
              left -= uint64_t(r);
            }
          } else {
            // A member larger than a batch: copied through the buffer in pieces.
            write_all_at(fd, head.data(), head.size(), int64_t(pos), shard);
            buf.resize(std::max(buf.size(), kBatchBytes));
            for (uint64_t done = 0; done < size;) {
              check_cancel(o.cancel, shard);
              const uint64_t take = std::min<uint64_t>(size - done, kBatchBytes);
              read_source(src_fd, buf.data(), take, p.m_off[m] + done, false, what);
              write_all_at(fd, buf.data(), size_t(take), int64_t(pos + head.size() + done), shard);
              done += take;
            }
            if (p.whole_files) read_source(src_fd, buf.data(), 0, size, true, what);
          }
          count(p, o, m);
        }
      }
    });
    check_cancel(o.cancel, p.final_paths[s0]);

    std::atomic<size_t> next_commit{0};
    parallel(thread_count(o.threads, nshards), [&](unsigned, std::atomic<bool>& failed) {
      for (size_t k; !failed.load(std::memory_order_relaxed) && (k = next_commit++) < nshards;) {
        const std::string& shard = p.final_paths[s0 + k];
        if (o.sync && ::fdatasync(out[k].get()) != 0) throw Error::os(errno, "sync", shard);
        if (::close(out[k].release()) != 0) throw Error::os(errno, "close", shard);
        if (::rename(p.tmp_paths[s0 + k].c_str(), shard.c_str()) != 0)
          throw Error::os(errno, "rename into place", shard);
        renamed[k] = 1;
      }
    });
  } catch (...) {
    cleanup();
    throw;
  }
}

}  // namespace

std::vector<uint64_t> shard_sizes(const Plan& p) {
  check_plan(p);
  const size_t shards = p.shard_first.size() - 1;
  std::vector<uint64_t> sizes(shards, kEndBytes);
  for (size_t s = 0; s < shards; ++s)
    for (uint64_t m = p.shard_first[s]; m < p.shard_first[s + 1]; ++m)
      sizes[s] += member_bytes(p.m_name_len[size_t(m)], p.m_size[size_t(m)]);
  return sizes;
}

Result run(const Plan& p, const Options& o) {
  const std::vector<uint64_t> sizes = shard_sizes(p);  // checks the plan
  const size_t shards = sizes.size();
  Result r;
  r.shards = shards;
  r.members = p.shard_first.back() - p.shard_first.front();
  for (uint64_t m = p.shard_first.front(); m < p.shard_first.back(); ++m) r.samples += p.m_first[size_t(m)];
  for (uint64_t b : sizes) r.bytes += b;
  if (shards == 0) return r;
  if (o.mode == Mode::kPerShard) {
    run_per_shard(p, o);
    return r;
  }
  // kScatter: an archive is opened once and shared by all threads (pread only); a tree's
  // files are opened one at a time.
  const Sources sources(p);
  std::vector<UniqueFd> src_fds;
  if (!p.whole_files) {
    src_fds.resize(p.src_offsets.size() - 1);
    for (size_t i = 0; i < src_fds.size(); ++i) src_fds[i] = sources.open(int64_t(i));
  }
  const size_t window = std::max<size_t>(1, o.max_open);
  for (size_t s0 = 0; s0 < shards; s0 += window)
    run_scatter_window(p, o, s0, std::min(shards, s0 + window), sizes, sources, src_fds);
  return r;
}

}  // namespace fastload::pack
