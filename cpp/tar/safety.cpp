// Member path and link target checks (reader.hpp). The checks are lexical: they look at
// strings only, never at the file system. They rely on the extractor creating every
// member without following symlinks in its parent path (openat2 RESOLVE_NO_SYMLINKS or
// O_NOFOLLOW walks), so that the directories named by a member path are real ones.
//
// Against PEP 706's data filter (the reference), the differences are all refusals:
//  - an absolute member path is refused (the filter strips the leading '/');
//  - any ".." component of a member path or hard link target is refused (the filter
//    accepts "a/../b", which resolves inside);
//  - a symlink target may climb with ".." only at its start ("../../lib/x"): a ".." after
//    a named component ("d/../x") is refused, because lexically it cancels "d" while on
//    disk it climbs from wherever "d" points. With symlink "r" -> "." (safe), the target
//    "r/../x" is lexically "x" but really the root's parent; the filter resolves existing
//    symlinks with realpath to see this, a lexical check cannot.
#include <string>
#include <string_view>
#include <vector>

#include "tar/reader.hpp"

namespace fastload::tar {

namespace {

bool refuse(std::string* why, std::string_view reason) {
  if (why) *why = std::string(reason);
  return false;
}

// The components of a '/'-separated path, without empty and "." ones.
std::vector<std::string_view> components(std::string_view p) {
  std::vector<std::string_view> out;
  while (!p.empty()) {
    const size_t slash = p.find('/');
    const std::string_view c = p.substr(0, slash);
    if (!c.empty() && c != ".") out.push_back(c);
    if (slash == std::string_view::npos) break;
    p.remove_prefix(slash + 1);
  }
  return out;
}

}  // namespace

bool safe_relative_path(std::string_view path, std::string* out, std::string* why) {
  if (path.empty()) return refuse(why, "empty name");
  if (path.find('\0') != std::string_view::npos) return refuse(why, "name contains a NUL byte");
  if (path.front() == '/') return refuse(why, "absolute path");
  const std::vector<std::string_view> parts = components(path);
  std::string norm;
  for (std::string_view c : parts) {
    if (c == "..") return refuse(why, "path contains a '..' component");
    if (!norm.empty()) norm += '/';
    norm += c;
  }
  // "." and "./" (what `tar -C dir .` writes first) name the extraction root itself:
  // safe, and normalised to "".
  if (out) *out = std::move(norm);
  return true;
}

bool safe_link_target(std::string_view link_path, std::string_view target, bool hard,
                      std::string* why) {
  if (target.empty()) return refuse(why, "empty link target");
  if (target.find('\0') != std::string_view::npos)
    return refuse(why, "link target contains a NUL byte");
  if (target.front() == '/') return refuse(why, "absolute link target");
  if (hard) {
    // An archive path, relative to the root like a member path.
    std::string norm, reason;
    if (!safe_relative_path(target, &norm, &reason)) return refuse(why, "hard link target: " + reason);
    if (norm.empty()) return refuse(why, "hard link to the extraction root");
    return true;
  }
  std::string where, reason;
  if (!safe_relative_path(link_path, &where, &reason)) return refuse(why, "link path: " + reason);
  if (where.empty()) return refuse(why, "link path names the extraction root");
  // Depth of the directory holding the link: how many ".." it can take.
  const size_t depth = components(where).size() - 1;
  size_t up = 0;
  bool named = false;
  for (std::string_view c : components(target)) {
    if (c != "..") {
      named = true;
    } else if (named) {
      return refuse(why, "link target has '..' after a named component");
    } else if (++up > depth) {
      return refuse(why, "link target points outside the extraction root");
    }
  }
  return true;
}

}  // namespace fastload::tar
