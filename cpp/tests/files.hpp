// Files for the native tests: a fresh temporary directory, whole files read and written.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace fastload::test {

// A new directory under $TMPDIR (or /tmp) named fastload-<what>-XXXXXX; "" (after
// printing why) when it cannot be made.
inline std::string make_temp_dir(const char* what) {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp");
  tmpl.append("/fastload-").append(what).append("-XXXXXX");
  if (!::mkdtemp(tmpl.data())) {
    std::perror("mkdtemp");
    return {};
  }
  return tmpl;
}

// The whole file ("" if it cannot be opened).
inline std::string read_file(const std::string& path) {
  std::string s;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return s;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  std::fclose(f);
  return s;
}

inline void write_file(const std::string& path, const std::string& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return;
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
}

}  // namespace fastload::test
