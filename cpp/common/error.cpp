#include "common/error.hpp"

#include <cstring>

namespace fastload {

std::string Error::format(int err, const std::string& op, const std::string& path,
                          const std::string& detail) {
  std::string msg = op;
  if (!path.empty()) msg += " '" + path + "'";
  if (!detail.empty()) msg += ": " + detail;
  else if (err > 0) msg += ": " + std::string(std::strerror(err));
  return msg;
}

}  // namespace fastload
