// A tiny assertion kit for the native tests (no test framework is available).
//
// CHECK(cond) and CHECK_EQ(a, b) report the file, line and expression (and for
// CHECK_EQ both values) and count the failure, then carry on, so one run shows every
// broken contract. A test's main() ends with `return fastload::test::exit_code();`.
// Exit code 77 means "skipped" (liburing's convention, SKIP_RETURN_CODE in CMake).
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>

namespace fastload::test {

inline int& failures() {
  static int n = 0;
  return n;
}

inline int exit_code() {
  if (failures() == 0) return 0;
  std::fprintf(stderr, "%d check(s) failed\n", failures());
  return 1;
}

constexpr int kSkip = 77;

template <typename T>
std::string show(const T& v) {
  if constexpr (std::is_same_v<T, bool>) return v ? "true" : "false";
  else if constexpr (std::is_enum_v<T>) return std::to_string(static_cast<long long>(v));
  else if constexpr (std::is_integral_v<T> || std::is_floating_point_v<T>) return std::to_string(v);
  else if constexpr (std::is_convertible_v<T, std::string>) {
    // Built with += : GCC 12 at -O3 warns falsely (-Wrestrict, bug 105329) on "x" + str.
    std::string out = "\"";
    out += std::string(v);
    out += '"';
    return out;
  }
  else return "?";
}

inline void fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", file, line, what.c_str());
  ++failures();
}

}  // namespace fastload::test

#define CHECK(cond)                                                 \
  do {                                                              \
    if (!(cond)) ::fastload::test::fail(__FILE__, __LINE__, #cond); \
  } while (0)

// Both sides are evaluated once. Compares with ==, so mixing signed and unsigned is
// the caller's business (cast one side).
#define CHECK_EQ(a, b)                                                                  \
  do {                                                                                  \
    const auto& check_a_ = (a);                                                         \
    const auto& check_b_ = (b);                                                         \
    if (!(check_a_ == check_b_))                                                        \
      ::fastload::test::fail(__FILE__, __LINE__,                                        \
                             std::string(#a " == " #b " (") +                           \
                                 ::fastload::test::show(check_a_) + " vs " +            \
                                 ::fastload::test::show(check_b_) + ")");               \
  } while (0)
