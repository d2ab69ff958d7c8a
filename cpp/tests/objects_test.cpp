// ObjectWriter (copy/objects.*): bodies written whole with their chunk digests and
// times, a file already at the name replaced, and a failure (a missing folder) kept per
// body, naming the file, with the others written and no temporary left behind; a body's
// mark recorded as the file's xattr.
#include "copy/objects.hpp"

#include <dirent.h>
#include <sys/stat.h>
#include <sys/xattr.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "check.hpp"
#include "common/error.hpp"
#include "files.hpp"
#include "hash/digest.hpp"

namespace {

using fastload::copy::ObjectBody;
using fastload::copy::ObjectWriter;

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  return out;
}

void test_batch(const std::string& root) {
  ::mkdir((root + "/sub").c_str(), 0755);
  fastload::test::write_file(root + "/sub/old", "an older copy");
  std::string big(10000, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = char(i * 7 + 3);
  const std::string small = "hello";
  std::vector<ObjectBody> bodies = {
      {"big", big.data(), big.size(), 1'600'000'000'123'456'789, "\"etag of big\""},
      {"sub/old", small.data(), small.size(), -1'500'000'001, ""},
      {"sub/empty", nullptr, 0, 0, ""},
      {"missing/x", small.data(), small.size(), 0, ""},
  };
  ObjectWriter w(root, 0644, 4096);
  std::vector<std::vector<uint64_t>> digests;
  std::vector<std::exception_ptr> errors;
  w.write_all(bodies, digests, errors);
  CHECK(!errors[0] && !errors[1] && !errors[2] && errors[3]);
  CHECK_EQ(fastload::test::read_file(root + "/big"), big);
  CHECK_EQ(fastload::test::read_file(root + "/sub/old"), small);
  CHECK_EQ(digests[0].size(), size_t(3));
  for (size_t k = 0; k < 3 && k < digests[0].size(); ++k) {
    const size_t n = k < 2 ? 4096 : big.size() - 8192;
    CHECK_EQ(digests[0][k], fastload::hash::fl64(big.data() + k * 4096, n));
  }
  CHECK_EQ(digests[2].size(), size_t(1));
  if (!digests[2].empty()) CHECK_EQ(digests[2][0], fastload::hash::fl64("", 0));
  struct stat st;
  CHECK(::stat((root + "/big").c_str(), &st) == 0);
  CHECK_EQ(int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
           int64_t(1'600'000'000'123'456'789));
  CHECK(::stat((root + "/sub/old").c_str(), &st) == 0);
  CHECK_EQ(int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
           int64_t(-1'500'000'001));
  try {
    std::rethrow_exception(errors[3]);
  } catch (const fastload::Error& e) {
    CHECK_EQ(e.err(), ENOENT);
    CHECK_EQ(e.path(), root + "/missing/x");
  }
  // The mark, where the file system keeps user attributes (the writer skips it silently
  // where not: the probe on "sub/empty" tells which).
  char mark[64];
  if (::setxattr((root + "/sub/empty").c_str(), "user.probe", "x", 1, 0) == 0) {
    const ssize_t n = ::getxattr((root + "/big").c_str(), fastload::copy::kObjectMark, mark,
                                 sizeof mark);
    CHECK_EQ(std::string(mark, n > 0 ? size_t(n) : 0), std::string("\"etag of big\""));
    CHECK(::getxattr((root + "/sub/old").c_str(), fastload::copy::kObjectMark, mark,
                     sizeof mark) < 0);
  }
  CHECK_EQ(names_in(root).size(), size_t(2));      // big, sub: no temporary
  CHECK_EQ(names_in(root + "/sub").size(), size_t(2));  // old, empty
}

}  // namespace

int main() {
  const std::string root = fastload::test::make_temp_dir("objects");
  if (root.empty()) return fastload::test::kSkip;
  test_batch(root);
  [[maybe_unused]] const int rc = std::system(("rm -rf '" + root + "'").c_str());
  return fastload::test::exit_code();
}
