// What the core answers about paths: the file-system table (each magic once, names and
// network marks as staging and probe rely on them), fs_magic and sync_fs (-errno, never
// a throw), and copy::stat_file (one regular file as a Tree; symlinks, directories and
// missing files refused).
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>

#include "check.hpp"
#include "files.hpp"
#include "common/error.hpp"
#include "copy/walk.hpp"
#include "io/fs.hpp"

using namespace fastload;

namespace {

std::string g_dir;

void test_table() {
  std::set<uint32_t> seen;
  for (const io::FsKind& k : io::file_systems()) {
    CHECK(seen.insert(k.magic).second);
    CHECK(k.name != nullptr && *k.name != '\0');
    CHECK(io::find_fs(k.magic) == &k);
  }
  const auto network = [](uint32_t magic) {
    const io::FsKind* k = io::find_fs(magic);
    return k != nullptr && k->network;
  };
  CHECK(network(0x6969));      // nfs
  CHECK(network(0x65735546));  // fuse
  CHECK(network(0x0BD00BD0));  // lustre
  CHECK(network(0x47504653));  // gpfs
  CHECK(!network(0xEF53));     // ext4
  CHECK(!network(0x01021994));  // tmpfs
  CHECK(std::string(io::find_fs(0xEF53)->name) == "ext4");
  CHECK(io::find_fs(0x12345678) == nullptr);
}

void test_magic_and_sync() {
  uint32_t magic = 0;
  CHECK_EQ(io::fs_magic(g_dir, &magic), 0);
  CHECK(magic != 0);
  uint32_t root = 0;
  CHECK_EQ(io::fs_magic("/proc", &root), 0);
  CHECK_EQ(root, 0x9fa0u);  // procfs
  uint32_t untouched = 7;
  CHECK_EQ(io::fs_magic(g_dir + "/missing/x", &untouched), -ENOENT);
  CHECK_EQ(untouched, 7u);
  CHECK_EQ(io::sync_fs(g_dir), 0);
  CHECK_EQ(io::sync_fs(g_dir + "/missing"), -ENOENT);
}

// Which Error stat_file throws (kind, errno), or nullopt-like {-1, -1} when none.
std::pair<int, int> stat_error(const std::string& root, const std::string& rel) {
  try {
    copy::stat_file(root, rel);
  } catch (const Error& e) {
    return {int(e.kind()), e.err()};
  }
  return {-1, -1};
}

void test_stat_file() {
  const std::string file = g_dir + "/a.bin";
  FILE* f = std::fopen(file.c_str(), "wb");
  CHECK(f != nullptr);
  std::fwrite("0123456789", 1, 10, f);
  std::fclose(f);
  CHECK_EQ(::chmod(file.c_str(), 0640), 0);

  const copy::Tree t = copy::stat_file(g_dir, "a.bin");
  CHECK_EQ(t.files, uint64_t(1));
  CHECK_EQ(t.total_bytes, uint64_t(10));
  CHECK_EQ(t.entries.size(), size_t(1));
  const copy::Entry& e = t.entries[0];
  CHECK(e.path == "a.bin");
  CHECK(e.type == copy::EntryType::kFile);
  CHECK_EQ(e.size, uint64_t(10));
  CHECK_EQ(e.mode, 0640u);
  struct stat st;
  CHECK_EQ(::stat(file.c_str(), &st), 0);
  CHECK_EQ(e.mtime_ns, int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec);
  CHECK_EQ(e.blocks, uint64_t(st.st_blocks));

  // An empty root: rel is the whole path.
  CHECK(copy::stat_file("", file).entries[0].path == file);

  CHECK_EQ(::symlink("a.bin", (g_dir + "/link").c_str()), 0);
  const auto unsupported = std::make_pair(int(ErrorKind::kUnsupported), 0);
  CHECK(stat_error(g_dir, "link") == unsupported);  // not followed
  CHECK(stat_error(g_dir, "") == unsupported);      // the root, a directory
  CHECK(stat_error(g_dir, "none") == std::make_pair(int(ErrorKind::kOs), ENOENT));
  ::unlink((g_dir + "/link").c_str());
  ::unlink(file.c_str());
}

}  // namespace

int main() {
  g_dir = test::make_temp_dir("fs-test");
  if (g_dir.empty()) return 1;
  test_table();
  test_magic_and_sync();
  test_stat_file();
  ::rmdir(g_dir.c_str());
  return test::exit_code();
}
