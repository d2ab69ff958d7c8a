#include "io/fs.hpp"

#include <fcntl.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>

#include "common/unique_fd.hpp"

namespace fastload::io {
namespace {

constexpr FsKind kKinds[] = {
    {0xEF53, "ext4", false},
    {0x58465342, "xfs", false},
    {0x9123683E, "btrfs", false},
    {0x01021994, "tmpfs", false},
    {0x794C7630, "overlayfs", false},
    {0x2FC12FC1, "zfs", false},
    {0x6969, "nfs", true},
    {0x65735546, "fuse", true},  // sshfs, gcsfuse, s3fs, netsim, ...
    {0x0BD00BD0, "lustre", true},
    {0x47504653, "gpfs", true},  // Spectrum Scale
    {0xFF534D42, "cifs", true},
    {0xFE534D42, "smb2", true},
    {0x00C36400, "cephfs", true},
    {0x19830326, "beegfs", true},
    {0x01021997, "9p", true},
    {0x5346414F, "afs", true},
    {0x013111A8, "ibrix", true},
    {0xAAD7AAEA, "panfs", true},
};

}  // namespace

std::span<const FsKind> file_systems() noexcept { return kKinds; }

const FsKind* find_fs(uint32_t magic) noexcept {
  for (const FsKind& k : kKinds)
    if (k.magic == magic) return &k;
  return nullptr;
}

int fs_magic(const std::string& path, uint32_t* magic) noexcept {
  struct statfs st;
  if (::statfs(path.c_str(), &st) != 0) return -errno;
  *magic = static_cast<uint32_t>(static_cast<unsigned long>(st.f_type) & 0xffffffffUL);
  return 0;
}

int sync_fs(const std::string& path) noexcept {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return -errno;
  if (::syncfs(fd.get()) != 0) return -errno;
  return 0;
}

}  // namespace fastload::io
