// The inside of ExtractJob (extract.hpp), shared by the files that implement it:
//   extract.cpp         the job: set-up, feeding (own buffers, lent read blocks, the
//                       mapped archive), finish, cancel and the results
//   extract_write.cpp   a member's file: created, written (copied into slots or straight
//                       from where the bytes lie, O_DIRECT where it can), digested, named
//                       once whole; the engine's completions; abort
//   extract_tree.cpp    the tar stream (Level: which member goes where, nested tars) and
//                       the tree around the files: directories opened without following
//                       links, symbolic and hard links, directory metadata, members
//                       adopted from an interrupted run
// Not part of the interface: only cpp/copy/extract*.cpp include it.
#pragma once

#include <time.h>

#include <cstdint>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "common/timespec.hpp"
#include "common/unique_fd.hpp"
#include "copy/decompress.hpp"
#include "copy/extract.hpp"
#include "hash/digest.hpp"
#include "io/engine.hpp"
#include "io/mapped.hpp"
#include "tar/reader.hpp"

namespace fastload::copy {

struct Level;

struct ExtractJob::Impl {
  static constexpr uint32_t kNone = ~0u;
  static constexpr int kFeedMapped = -2;          // feed_from(): the data lies in the mapping
  static constexpr uint64_t kMappedLag = 64u << 20;  // mapped pages kept this far behind the parser
  static constexpr size_t kMaxCachedDirs = 512;
  static constexpr size_t kBlockAlign = 4096;  // read blocks: O_DIRECT needs page alignment

  // An engine operation's user_data: the file, what was asked, and the piece written.
  enum Kind : uint64_t { kOpen = 1, kWrite, kClose };
  static uint64_t tag(uint32_t file, Kind kind, uint32_t slot = 0) {
    return (uint64_t(file) << 32) | (uint64_t(slot) << 4) | kind;
  }

  // Page-aligned memory: buffers for O_DIRECT reads and writes.
  static std::shared_ptr<char[]> aligned_buffer(size_t n) {
    return std::shared_ptr<char[]>(
        static_cast<char*>(::operator new[](n, std::align_val_t{kBlockAlign})),
        [](char* p) { ::operator delete[](p, std::align_val_t{kBlockAlign}); });
  }

  // "a/b/c" -> ("a/b", "c"); "c" -> ("", "c").
  static std::pair<std::string, std::string> split(const std::string& path) {
    auto slash = path.rfind('/');
    if (slash == std::string::npos) return {"", path};
    return {path.substr(0, slash), path.substr(slash + 1)};
  }

  struct File {
    bool active = false;
    std::string path;  // output path, relative to the destination
    std::string base;
    std::string tmp;   // temporary name, in the parent directory
    std::shared_ptr<UniqueFd> dir;  // the parent directory (kept open while in flight)
    int dir_fd = -1;                // dir's descriptor
    int fd = -1;
    bool opened = false;
    bool data_done = false;
    bool closing = false;
    uint32_t mode = 0;
    int64_t mtime_ns = 0;
    uint64_t appended = 0;  // bytes of data received
    uint64_t pos = 0;       // where the next byte goes (past holes, for a sparse file)
    bool sparse = false;    // a sparse member: holes skipped, truncated to `size` at the end
    uint64_t size = 0;
    uint32_t create_mode = 0600;
    bool anon = false;      // an O_TMPFILE: linked into place by name once whole
    bool chmod = true;      // the umask strips bits of the mode: set it after writing
    uint32_t slot = kNone;  // the arena slot being filled (data copied in)
    size_t fill = 0;
    uint64_t slot_offset = 0;
    unsigned writes = 0;  // writes queued or in flight
    std::vector<uint32_t> waiting;  // pieces not yet pushed, in file order (see flush())
    size_t waiting_head = 0;
    bool direct = false;        // opened O_DIRECT: see direct_end
    uint64_t direct_end = 0;    // pages below this are written O_DIRECT, the rest buffered
    hash::Fl64Stream stream = hash::Fl64Stream(0);
    uint64_t chunk_fill = 0;
    std::vector<uint64_t> digests;
  };
  // One write: a filled arena slot, or a span of a lent read block written in place.
  struct Piece {
    uint32_t file = 0;
    const char* buf = nullptr;
    size_t len = 0;
    size_t put = 0;
    uint64_t offset = 0;
    uint32_t slot = kNone;   // the arena slot to free once written
    uint32_t block = kNone;  // the read block to unpin once written
    bool direct = false;     // issued O_DIRECT
  };
  struct DirMeta {
    std::string path;
    uint32_t mode;
    int64_t mtime_ns;
  };
  struct Hardlink {
    std::string path, target;
  };
  struct Symlink {
    std::string path;
    int64_t mtime_ns;
  };

  // ---- the job (extract.cpp) ---------------------------------------------------------
  Impl(ExtractJob& j, std::string d, std::string n, ExtractOptions o);
  ~Impl();
  void init_direct_writes();
  const io::MappedFile& mapping() const;
  Output parse_output();
  // While waiting for the decoder, the parsing thread reaps write completions (and sees
  // a cancel).
  DecompressThread::Poll poll() {
    return [this] { pump(false); };
  }
  void check_lent(int b) const {
    if (b < 0 || size_t(b) >= block_lent.size() || !block_lent[size_t(b)])
      throw std::out_of_range("ExtractJob: read block " + std::to_string(b) + " is not lent");
  }
  void unlend() {
    lent_block = kNone;
    lent_lo = lent_hi = nullptr;
  }

  // ---- the tree (extract_tree.cpp) ---------------------------------------------------
  // Opens (creating if needed) the directory `path` below the destination, one
  // component at a time with O_NOFOLLOW from an already verified parent: no symlink,
  // whoever made it, is ever followed.
  int ensure_dir(const std::string& path) { return dir_ref(path)->get(); }
  const std::shared_ptr<UniqueFd>& dir_ref(const std::string& path);
  void drop_dir_cache() { dir_fds.clear(); }
  // A directory member's directory: made (with ensure_dir()), replacing a file or other
  // non-directory, not a symbolic link, that is at its path.
  void make_dir(const std::string& path);
  void make_symlink(const std::string& out, const std::string& target, int64_t mtime_ns);
  void make_hardlinks();
  void set_dir_metadata();
  bool adopt(const std::string& out, const tar::Member& m);
  void note_skipped(const std::string& out);
  bool selected(const std::string& out) const;

  // ---- members' files (extract_write.cpp) --------------------------------------------
  void start_file(const std::string& out, const tar::Member& m, uint32_t* index);
  void append(uint32_t i, const char* p, size_t n);
  // A sparse file's next data goes at `to`: the bytes before it are a hole (not written,
  // digested as zeros).
  void hole_to(uint32_t i, uint64_t to);
  void digest(File& f, const char* p, size_t n);
  void end_file(uint32_t i);
  void push_open(uint32_t i);
  char* slot_data(uint32_t s);
  uint32_t new_piece();
  void submit_slot(uint32_t i);
  void queue_piece(uint32_t i, uint32_t k);
  bool direct_ok(const Piece& pc) const;
  void flush(uint32_t i);
  void push_write(uint32_t k);
  void unpin(uint32_t b) {
    if (--block_pins[b] == 0) free_blocks.push_back(b);
  }
  void maybe_close(uint32_t i);
  void link_into_place(File& f);
  bool link_anon(const File& f, const char* as);
  void file_closed(uint32_t i);
  // The engine.
  void push(io::Op op, uint64_t user_data);
  void pump(bool block);
  void complete(const io::Completion& c);
  void abort() noexcept;

  std::string full(const std::string& rel) const { return rel.empty() ? dst : dst + "/" + rel; }
  Error unsafe(const std::string& member, const std::string& why) const {
    return Error(ErrorKind::kUnsafe, 0, "refusing archive member", name + ": " + member, why);
  }

  ExtractJob& job;
  std::string dst;
  std::string name;
  ExtractOptions opt;
  std::unique_ptr<io::Engine> eng;
  std::shared_ptr<UniqueFd> root;
  uint32_t umask_bits = 022;
  bool tmpfile_ok = true;     // O_TMPFILE works in the destination (until it fails)
  bool tmpfile_seen = false;  // ... and has worked once
  bool link_by_fd = true;     // linkat(AT_EMPTY_PATH) is allowed
  // O_DIRECT writes: whether new files use them, and the alignment the destination asks
  // of buffers and offsets (statx STATX_DIOALIGN).
  bool direct_writes = false;
  size_t dio_mem_align = kBlockAlign;
  size_t dio_offset_align = kBlockAlign;
  size_t page_size = kBlockAlign;
  std::unique_ptr<DecompressThread> decoder;  // compressed archives only
  std::unique_ptr<Level> outer;
  std::shared_ptr<char[]> arena;  // write slots (page-aligned, fit for O_DIRECT writes)
  std::vector<uint32_t> free_slots;
  std::vector<Piece> pieces;  // fixed size: references stay valid across pump()
  std::vector<uint32_t> free_pieces;
  std::shared_ptr<char[]> blocks;      // lent read blocks
  std::vector<uint32_t> block_pins;    // pieces writing from each, +1 while lent
  std::vector<bool> block_lent;
  std::vector<uint32_t> free_blocks;
  // While feeding: data in [lent_lo, lent_hi) is written from where it lies (null: none
  // is); lent_block, if any, is the read block it is in, pinned by each such write.
  uint32_t lent_block = kNone;
  const char* lent_lo = nullptr;
  const char* lent_hi = nullptr;
  std::unique_ptr<io::MappedFile> mapped;  // the archive, with map_source()
  uint64_t mapped_released = 0;            // pages below this were released
  std::vector<File> files;
  std::vector<uint32_t> free_files;
  size_t active = 0;
  std::unordered_set<std::string> active_paths;
  std::unordered_map<std::string, std::shared_ptr<UniqueFd>> dir_fds;
  std::unordered_set<std::string> dirs_made;
  std::vector<DirMeta> dir_meta;
  std::vector<Hardlink> hardlinks;
  std::vector<ExtractedLink> links;
  std::vector<ExtractedFile> done;
  std::vector<std::string> reused;
  // What GNU tar would warn about (tar::Sink::on_warning), until take_warnings(); at
  // most kMaxWarnings kept, the rest only counted.
  static constexpr size_t kMaxWarnings = 1000;
  std::vector<std::string> warnings;
  uint64_t warnings_dropped = 0;
  bool dead = false;
  std::string engine_name;
};

// One tar stream: the archive itself, or a member tar inside it (nested). Its
// callbacks are in extract_tree.cpp.
struct Level final : tar::Sink {
  Level(ExtractJob::Impl& im, std::string prefix, const std::string& name, bool inner)
      : im_(im), prefix_(std::move(prefix)), inner_(inner), name_(name), parser(name) {}

  tar::Action on_member(const tar::Member& m) override;
  void on_data(const char* data, size_t n) override;
  void on_member_end() override;
  void on_warning(const std::string& message) override;
  std::string parser_name() const { return name_; }

  static constexpr uint32_t kNone = ExtractJob::Impl::kNone;
  static constexpr uint32_t kInner = kNone - 1;
  ExtractJob::Impl& im_;
  std::string prefix_;
  bool inner_;
  std::string name_;
  uint32_t current_ = kNone;
  // The current member's extents when it is sparse, the one being filled and its rest.
  std::vector<tar::SparseExtent> extents_;
  size_t extent_ = 0;
  uint64_t extent_left_ = 0;
  std::unique_ptr<Level> child_;
  tar::StreamParser parser;
};

}  // namespace fastload::copy
