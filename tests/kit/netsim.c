/* netsim: the tests' stand-in for network storage (NFS, Lustre, a FUSE bucket mount).
 *
 * A FUSE file system (read-only unless NETSIM_WRITE is set) that shows a local directory
 * and answers every request only after a fixed delay: META_US microseconds for each
 * metadata request (lookup and stat, open, opendir, readdir, readlink, access, statfs),
 * READ_US for each read request (the kernel splits reads into requests of at most 128 KiB). Requests are
 * served by many threads, so requests in flight at once overlap their delays, as round
 * trips to a server do.
 *
 *   netsim mount SRC MNT META_US READ_US   mounts, then returns (the server runs on)
 *   netsim umount MNT                      unmounts; the server writes its counts, exits
 *
 * Environment of `netsim mount`:
 *   NETSIM_WRITE=1      writable, for a destination: creates, writes, links, renames,
 *                       removals, modes and times pass through to SRC; each such request
 *                       is a metadata one (META_US, counted in `meta`), each write request
 *                       waits READ_US (not counted). No O_TMPFILE: libfuse has no call for
 *                       it, so the kernel refuses one (EOPNOTSUPP), as NFS does.
 *   NETSIM_DIRECT=1     files are opened with FUSE direct_io: no page cache for them, so
 *                       processes on this machine share nothing they read, like nodes
 *                       reading one store (such files cannot be memory-mapped). Mounts
 *                       never share a page cache: each is its own file system.
 *   NETSIM_STATS=FILE   at unmount, FILE gets one "name count" line each, in this order:
 *                       opens, reads, read_bytes (bytes served by reads), meta (metadata
 *                       requests, opens included); written whole (renamed into place).
 *
 * Needs /dev/fuse and root (or fusermount3). Built by tests/kit/netsim.py:
 *   cc -O2 -Wall -Wextra -Werror netsim.c -o netsim $(pkg-config --cflags --libs fuse3)
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 312
#include <fuse3/fuse.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#define MAX_THREADS 64

struct counts {
    atomic_ullong opens, reads, read_bytes, meta;
};

static struct {
    int src;                 /* the shown directory, opened before mounting */
    long meta_ns, read_ns;   /* delay per request */
    int direct;              /* direct_io on files */
    int write;               /* writable (NETSIM_WRITE) */
    char stats[PATH_MAX];    /* where the counts go ("" for nowhere) */
    struct counts n;
} ns;

/* FUSE paths start with "/"; the *at() calls take them relative to ns.src. */
static const char *rel(const char *path) {
    while (*path == '/') path++;
    return *path ? path : ".";
}

static void wait_ns(long delay) {
    if (delay <= 0) return;
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += delay / 1000000000L;
    until.tv_nsec += delay % 1000000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) == EINTR) {
    }
}

/* A metadata round trip: the delay, then the count. */
static void meta_request(void) {
    wait_ns(ns.meta_ns);
    atomic_fetch_add_explicit(&ns.n.meta, 1, memory_order_relaxed);
}

static void *ns_init(struct fuse_conn_info *conn, struct fuse_config *cfg) {
    (void)conn;
    cfg->use_ino = 1;       /* the source's inode numbers */
    cfg->kernel_cache = 0;  /* cached pages dropped at each open (close-to-open) */
    cfg->direct_io = ns.direct;
    cfg->hard_remove = 1;   /* an open file removed is gone, not renamed to .fuse_hidden* */
    return NULL;
}

static int ns_getattr(const char *path, struct stat *st, struct fuse_file_info *fi) {
    meta_request();
    int r = fi ? fstat((int)fi->fh, st) : fstatat(ns.src, rel(path), st, AT_SYMLINK_NOFOLLOW);
    return r < 0 ? -errno : 0;
}

static int ns_readlink(const char *path, char *buf, size_t size) {
    meta_request();
    if (size == 0) return -EINVAL;
    ssize_t len = readlinkat(ns.src, rel(path), buf, size - 1);
    if (len < 0) return -errno;
    buf[len] = '\0';
    return 0;
}

static int ns_access(const char *path, int mask) {
    meta_request();
    return faccessat(ns.src, rel(path), mask, 0) < 0 ? -errno : 0;
}

static int ns_statfs(const char *path, struct statvfs *sv) {
    meta_request();
    (void)path;
    return fstatvfs(ns.src, sv) < 0 ? -errno : 0;
}

/* An open (or create) of SRC's file as the request's handle: counted, its cache mode set;
 * else the errno. */
static int opened(struct fuse_file_info *fi, int fd) {
    if (fd < 0) return -errno;
    fi->fh = (uint64_t)fd;
    fi->direct_io = ns.direct;
    fi->keep_cache = 0;
    atomic_fetch_add_explicit(&ns.n.opens, 1, memory_order_relaxed);
    return 0;
}

static int ns_open(const char *path, struct fuse_file_info *fi) {
    meta_request();
    if (!ns.write && (fi->flags & O_ACCMODE) != O_RDONLY) return -EROFS;
    int flags = ns.write ? fi->flags & (O_ACCMODE | O_TRUNC | O_APPEND) : O_RDONLY;
    return opened(fi, openat(ns.src, rel(path), flags | O_NOFOLLOW | O_CLOEXEC));
}

static int ns_read(const char *path, char *buf, size_t size, off_t off,
                   struct fuse_file_info *fi) {
    (void)path;
    wait_ns(ns.read_ns);
    size_t done = 0;
    while (done < size) {  /* a short read means end of file to the kernel */
        ssize_t got = pread((int)fi->fh, buf + done, size - done, off + (off_t)done);
        if (got < 0) {
            if (errno == EINTR) continue;
            if (done == 0) return -errno;
            break;
        }
        if (got == 0) break;
        done += (size_t)got;
    }
    atomic_fetch_add_explicit(&ns.n.reads, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&ns.n.read_bytes, done, memory_order_relaxed);
    return (int)done;
}

static int ns_release(const char *path, struct fuse_file_info *fi) {
    (void)path;
    close((int)fi->fh);
    return 0;
}

static int ns_opendir(const char *path, struct fuse_file_info *fi) {
    meta_request();
    int fd = openat(ns.src, rel(path), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -errno;
    DIR *dir = fdopendir(fd);
    if (dir == NULL) {
        int e = errno;
        close(fd);
        return -e;
    }
    fi->fh = (uint64_t)(uintptr_t)dir;
    return 0;
}

static int ns_readdir(const char *path, void *buf, fuse_fill_dir_t fill, off_t off,
                      struct fuse_file_info *fi, enum fuse_readdir_flags flags) {
    (void)path;
    (void)off;
    (void)flags;
    meta_request();
    DIR *dir = (DIR *)(uintptr_t)fi->fh;
    rewinddir(dir);  /* the whole listing in one go: libfuse keeps it for later calls */
    for (;;) {
        errno = 0;
        struct dirent *de = readdir(dir);
        if (de == NULL) return errno ? -errno : 0;
        struct stat st;
        memset(&st, 0, sizeof st);
        st.st_ino = de->d_ino;
        st.st_mode = (mode_t)DTTOIF(de->d_type);
        if (fill(buf, de->d_name, &st, 0, 0) != 0) return 0;
    }
}

static int ns_releasedir(const char *path, struct fuse_file_info *fi) {
    (void)path;
    closedir((DIR *)(uintptr_t)fi->fh);
    return 0;
}


/* ---- NETSIM_WRITE: requests that change the tree, each passed through to SRC ---- */

static int ns_create(const char *path, mode_t mode, struct fuse_file_info *fi) {
    meta_request();
    /* The kernel has applied the caller's umask to mode (the server's is 0). */
    int flags = fi->flags & (O_ACCMODE | O_EXCL | O_TRUNC | O_APPEND);
    return opened(fi, openat(ns.src, rel(path), flags | O_CREAT | O_NOFOLLOW | O_CLOEXEC, mode));
}

static int ns_write(const char *path, const char *buf, size_t size, off_t off,
                    struct fuse_file_info *fi) {
    (void)path;
    wait_ns(ns.read_ns);
    size_t done = 0;
    while (done < size) {
        ssize_t put = pwrite((int)fi->fh, buf + done, size - done, off + (off_t)done);
        if (put < 0) {
            if (errno == EINTR) continue;
            if (done == 0) return -errno;  /* ENOSPC, say: the writer sees it */
            break;
        }
        done += (size_t)put;
    }
    return (int)done;
}

static int ns_fsync(const char *path, int datasync, struct fuse_file_info *fi) {
    (void)path;
    meta_request();
    return (datasync ? fdatasync((int)fi->fh) : fsync((int)fi->fh)) < 0 ? -errno : 0;
}

static int ns_truncate(const char *path, off_t size, struct fuse_file_info *fi) {
    meta_request();
    if (fi) return ftruncate((int)fi->fh, size) < 0 ? -errno : 0;
    int fd = openat(ns.src, rel(path), O_WRONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return -errno;
    int r = ftruncate(fd, size) < 0 ? -errno : 0;
    close(fd);
    return r;
}

static int ns_chmod(const char *path, mode_t mode, struct fuse_file_info *fi) {
    meta_request();
    int r = fi ? fchmod((int)fi->fh, mode) : fchmodat(ns.src, rel(path), mode, 0);
    return r < 0 ? -errno : 0;
}

static int ns_chown(const char *path, uid_t uid, gid_t gid, struct fuse_file_info *fi) {
    meta_request();
    int r = fi ? fchown((int)fi->fh, uid, gid)
               : fchownat(ns.src, rel(path), uid, gid, AT_SYMLINK_NOFOLLOW);
    return r < 0 ? -errno : 0;
}

static int ns_utimens(const char *path, const struct timespec tv[2],
                      struct fuse_file_info *fi) {
    meta_request();
    int r = fi ? futimens((int)fi->fh, tv)
               : utimensat(ns.src, rel(path), tv, AT_SYMLINK_NOFOLLOW);
    return r < 0 ? -errno : 0;
}

static int ns_mkdir(const char *path, mode_t mode) {
    meta_request();
    return mkdirat(ns.src, rel(path), mode) < 0 ? -errno : 0;
}

static int ns_unlink(const char *path) {
    meta_request();
    return unlinkat(ns.src, rel(path), 0) < 0 ? -errno : 0;
}

static int ns_rmdir(const char *path) {
    meta_request();
    return unlinkat(ns.src, rel(path), AT_REMOVEDIR) < 0 ? -errno : 0;
}

static int ns_rename(const char *from, const char *to, unsigned int flags) {
    meta_request();
    return renameat2(ns.src, rel(from), ns.src, rel(to), flags) < 0 ? -errno : 0;
}

static int ns_link(const char *from, const char *to) {
    meta_request();
    return linkat(ns.src, rel(from), ns.src, rel(to), 0) < 0 ? -errno : 0;
}

static int ns_symlink(const char *target, const char *path) {
    meta_request();
    return symlinkat(target, ns.src, rel(path)) < 0 ? -errno : 0;
}

static const struct fuse_operations ops = {
    .init = ns_init,
    .getattr = ns_getattr,
    .readlink = ns_readlink,
    .access = ns_access,
    .statfs = ns_statfs,
    .open = ns_open,
    .read = ns_read,
    .release = ns_release,
    .opendir = ns_opendir,
    .readdir = ns_readdir,
    .releasedir = ns_releasedir,
    /* used only where mounted writable (a read-only mount refuses these itself) */
    .create = ns_create,
    .write = ns_write,
    .fsync = ns_fsync,
    .truncate = ns_truncate,
    .chmod = ns_chmod,
    .chown = ns_chown,
    .utimens = ns_utimens,
    .mkdir = ns_mkdir,
    .unlink = ns_unlink,
    .rmdir = ns_rmdir,
    .rename = ns_rename,
    .link = ns_link,
    .symlink = ns_symlink,
};

/* The counts, written to a temporary name and renamed: a reader sees all or nothing. */
static void write_stats(void) {
    if (ns.stats[0] == '\0') return;
    char tmp[PATH_MAX + 16];
    snprintf(tmp, sizeof tmp, "%s.%ld", ns.stats, (long)getpid());
    FILE *f = fopen(tmp, "w");
    if (f == NULL) return;
    fprintf(f, "opens %llu\nreads %llu\nread_bytes %llu\nmeta %llu\n",
            (unsigned long long)atomic_load(&ns.n.opens),
            (unsigned long long)atomic_load(&ns.n.reads),
            (unsigned long long)atomic_load(&ns.n.read_bytes),
            (unsigned long long)atomic_load(&ns.n.meta));
    if (fclose(f) == 0) rename(tmp, ns.stats);
    else unlink(tmp);
}

static int parse_us(const char *s, long *ns_out) {
    char *end;
    errno = 0;
    long us = strtol(s, &end, 10);
    if (errno || end == s || *end || us < 0 || us > 60L * 1000 * 1000) return -1;
    *ns_out = us * 1000L;
    return 0;
}

static int usage(void) {
    fprintf(stderr, "usage: netsim mount SRC MNT META_US READ_US\n"
                    "       netsim umount MNT\n");
    return 2;
}

static int do_mount(char **argv) {
    const char *src = argv[0], *mnt = argv[1];
    if (parse_us(argv[2], &ns.meta_ns) || parse_us(argv[3], &ns.read_ns)) {
        fprintf(stderr, "netsim: META_US and READ_US are microseconds (0 to 60 s)\n");
        return 2;
    }
    const char *direct = getenv("NETSIM_DIRECT");
    ns.direct = direct != NULL && atoi(direct) > 0;
    const char *write = getenv("NETSIM_WRITE");
    ns.write = write != NULL && atoi(write) > 0;
    if (ns.write) umask(0);  /* modes arrive with the caller's umask applied */
    const char *stats = getenv("NETSIM_STATS");
    if (stats != NULL && *stats) {
        /* The server runs from "/": a relative name is made absolute here. */
        char cwd[PATH_MAX];
        int len = stats[0] == '/' ? snprintf(ns.stats, sizeof ns.stats, "%s", stats)
                  : getcwd(cwd, sizeof cwd) == NULL ? -1
                  : snprintf(ns.stats, sizeof ns.stats, "%s/%s", cwd, stats);
        if (len < 0 || (size_t)len >= sizeof ns.stats) {
            fprintf(stderr, "netsim: NETSIM_STATS is too long\n");
            return 2;
        }
    }
    ns.src = open(src, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (ns.src < 0) {
        fprintf(stderr, "netsim: %s: %s\n", src, strerror(errno));
        return 1;
    }
    if (mkdir(mnt, 0755) < 0 && errno != EEXIST) {
        fprintf(stderr, "netsim: %s: %s\n", mnt, strerror(errno));
        return 1;
    }

    /* allow_other: every user reaches it, as a shared store; default_permissions: the
     * kernel checks modes against the source's attributes. */
    char *fargv[] = {"netsim", "-o",
                     ns.write ? "rw,allow_other,default_permissions,fsname=netsim,subtype=netsim"
                              : "ro,allow_other,default_permissions,fsname=netsim,subtype=netsim",
                     NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
    struct fuse *fuse = fuse_new(&args, &ops, sizeof ops, NULL);
    if (fuse == NULL) {
        fprintf(stderr, "netsim: fuse_new failed\n");
        return 1;
    }
    if (fuse_mount(fuse, mnt) != 0) {
        fprintf(stderr, "netsim: cannot mount at %s (needs /dev/fuse, root or fusermount3)\n",
                mnt);
        fuse_destroy(fuse);
        return 1;
    }
    /* Mounted: the caller returns now; the server goes on in the background. */
    if (fuse_daemonize(0) != 0) {
        fuse_unmount(fuse);
        fuse_destroy(fuse);
        return 1;
    }
    struct fuse_session *se = fuse_get_session(fuse);
    if (fuse_set_signal_handlers(se) != 0) {
        fuse_unmount(fuse);
        fuse_destroy(fuse);
        return 1;
    }
#if FUSE_MINOR_VERSION >= 12
    struct fuse_loop_config *loop = fuse_loop_cfg_create();
    fuse_loop_cfg_set_max_threads(loop, MAX_THREADS);
    fuse_loop_cfg_set_idle_threads(loop, MAX_THREADS);
    int rc = fuse_loop_mt(fuse, loop);
    fuse_loop_cfg_destroy(loop);
#else
    struct fuse_loop_config loop = {.clone_fd = 0, .max_idle_threads = MAX_THREADS};
    int rc = fuse_loop_mt(fuse, &loop);
#endif
    fuse_remove_signal_handlers(se);
    fuse_unmount(fuse);
    fuse_destroy(fuse);
    write_stats();
    return rc == 0 ? 0 : 1;
}

static int do_umount(const char *mnt) {
    if (umount2(mnt, 0) == 0) return 0;
    if (errno != EPERM) {
        fprintf(stderr, "netsim: umount %s: %s\n", mnt, strerror(errno));
        return 1;
    }
    execlp("fusermount3", "fusermount3", "-u", mnt, (char *)NULL);
    fprintf(stderr, "netsim: fusermount3: %s\n", strerror(errno));
    return 1;
}

int main(int argc, char **argv) {
    if (argc == 6 && strcmp(argv[1], "mount") == 0) return do_mount(argv + 2);
    if (argc == 3 && strcmp(argv[1], "umount") == 0) return do_umount(argv[2]);
    return usage();
}
