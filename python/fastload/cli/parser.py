"""The command line's parser: every subcommand and its options, the help texts, and an
unknown option answered with the closest one."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Sequence

from .._util import version
from ..staging.job import (
    LOCAL_PER_CORE,
    MAX_NETWORK_FILES,
    MAX_SUBMITTERS,
    NETWORK_PER_CORE,
)


def _progress_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="show a progress bar (default: when stderr is a terminal)",
    )
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _want_progress(args: argparse.Namespace) -> bool:
    return sys.stderr.isatty() if args.progress is None else bool(args.progress)


class _Version(argparse.Action):
    """``--version``, the version looked up only when asked (importlib.metadata costs
    every command ~25 ms)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:  # fmt: skip
        print(f"fastload {version()}")
        parser.exit()


# --workers' default: staging.job.in_flight's rule (what probe reports), from its
# constants; objects, staging.remote's (not imported by a local stage; test_first_hour).
_OBJECTS_IN_FLIGHT = 64
_WORKERS_HELP = (
    f"files (or objects) in flight (default: {LOCAL_PER_CORE} per core, up to "
    f"{MAX_SUBMITTERS} cores, from a local disk; {NETWORK_PER_CORE} per core per "
    f"millisecond of latency from a network file system, at most {MAX_NETWORK_FILES}; "
    f"{_OBJECTS_IN_FLIGHT} objects from a store. 'fastload probe SRC' prints the "
    "number for SRC and measures what pays off)"
)


class _Parser(argparse.ArgumentParser):
    """Answers an unknown option with its subcommand's usage and its closest option."""

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:  # fmt: skip
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            where = _subcommand(self, parsed)
            unknown = next((a for a in extra if a.startswith("-")), extra[0])
            options = [o for a in where._actions for o in a.option_strings if o.startswith("--")]
            close = difflib.get_close_matches(unknown.split("=", 1)[0], options, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            what = "option" if unknown.startswith("-") else "argument"
            where.error(f"unrecognized {what} {unknown!r}{hint}")
        return parsed


def _subcommand(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand's parser that ``args`` went through (``p`` if none)."""
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            name = getattr(args, a.dest or "", None)
            if name in a.choices:
                return _subcommand(a.choices[name], args)
    return p


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="fastload",
        description=__doc__,
        epilog="Run 'fastload COMMAND --help' for the options of one command.",
    )
    p.add_argument(
        "--version", action=_Version, nargs=0, help="show program's version number and exit"
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "stage",
        help="copy a file or tree to node-local disk",
        description="Copy SRC (a file or a directory) to DST, resumably; a "
        "second run of an unchanged source returns at once.",
    )
    s.add_argument(
        "src", help="a file, a directory, an archive, s3://..., http(s)://... (a file or an "
        "archive, downloaded resumably), or - for a tar stream on stdin (plain, gzip or zstd)"
    )
    s.add_argument(
        "dst", help="the node-local directory (or file, for a file not unpacked) to write; "
        "made if missing, e.g. $SLURM_TMPDIR/data"
    )
    s.add_argument("--include", action="append", default=None, metavar="GLOB",
                   help="only paths matching GLOB (repeatable)")  # fmt: skip
    s.add_argument("--exclude", action="append", default=None, metavar="GLOB",
                   help="leave out paths matching GLOB (repeatable)")  # fmt: skip
    s.add_argument(
        "--engine", choices=["auto", "uring", "pread"], default="auto",
        help="how files are read and written: io_uring, or pread/pwrite in threads "
        "(default auto: io_uring where the kernel allows it, pread for a source on a "
        "network file system)",
    )  # fmt: skip
    s.add_argument("--workers", type=int, default=None, help=_WORKERS_HELP)
    s.add_argument("--stripe-size", type=int, default=None, help="bytes per stripe of big files")
    s.add_argument(
        "--nested",
        action="store_true",
        help="archives and trees: also extract the tars and zips inside, each into a "
             "directory named after it (without .zip)",
    )
    unpack = s.add_mutually_exclusive_group()
    unpack.add_argument(
        "--unpack",
        action="store_true",
        help="SRC must be an archive (.tar, .tar.gz, .tgz, .tar.zst, .zip): extract it",
    )
    unpack.add_argument(
        "--no-unpack",
        action="store_true",
        help="archives: copy the archive file instead of extracting it",
    )
    s.add_argument(
        "--checksum",
        default=None,
        metavar="ALGO:HEX",
        help="published checksum of the archive or file (md5:... or sha256:...)",
    )
    s.add_argument(
        "--sync",
        action="store_true",
        help="flush the data to disk before returning (default: return once it is in the "
        "page cache, like cp and tar; it is read back and checked after a reboot)",
    )
    s.add_argument(
        "--fanout",
        action="store_true",
        help="on a job over several nodes (run by every task, e.g. srun --ntasks-per-node=1 "
        "fastload stage --fanout ...): the nodes read the source once in total and exchange "
        "it over torch.distributed (gloo), or MPI under an MPI launcher with mpi4py, each "
        "writing the whole copy to its own DST",
    )
    s.add_argument(
        "--fanout-transport",
        choices=("torch", "mpi"),
        default=None,
        help="with --fanout (implied): exchange over this transport instead of choosing",
    )
    s.add_argument(
        "--repair",
        action="store_true",
        help="first re-read what an earlier stage put in DST (like 'fastload verify'), "
        "then re-copy whatever differs or is missing",
    )
    s.add_argument(
        "--allow-empty",
        action="store_true",
        help="stage nothing without an error where the source holds nothing to stage (a "
        "prefix with no objects, --include patterns that match nothing)",
    )
    s.add_argument(
        "--strict-source",
        action="store_true",
        help="fail where the source cannot be checked (a store that cannot be reached) "
        "instead of using a complete copy staged before",
    )
    s.add_argument(
        "--stats",
        action="store_true",
        help="then say where the time went: waiting for the lock, listing and planning, "
        "copying, CPU time, and bytes and files per second over time",
    )
    s.add_argument(
        "--background",
        action="store_true",
        help="return once the stage is under way, run by a process of its own that serves "
        "readers (fastload.stage(SRC, DST, wait=False) reads through it: "
        "docs/read-while-staging.md)",
    )
    s.add_argument(
        "--serve",
        action="store_true",
        help="stage as with --background, in this process (what --background runs): "
        "readers read through it while it stages; returns at the stage's end",
    )
    s.add_argument(
        "--skip-special",
        action="store_true",
        help="skip devices, FIFOs, sockets and symlinks leaving the tree",
    )
    z = s.add_argument_group("zip archives (docs/zip.md)")
    z.add_argument("--zip-encoding", default=None, metavar="CODEPAGE",
                   help="code page of names not flagged UTF-8 (default: cp437 for zips "
                   "made on DOS/Windows, the bytes as they are for others)")
    z.add_argument("--zip-max-ratio", type=float, default=None, metavar="N",
                   help="refuse a member expanding more than N times (default 10000)")
    z.add_argument("--zip-max-size", type=int, default=None, metavar="BYTES",
                   help="refuse a zip whose members hold more than BYTES uncompressed")
    store = s.add_argument_group("object stores (SRC = s3://bucket/prefix/ or s3://bucket/key)")
    store.add_argument(
        "--endpoint-url",
        default=None,
        metavar="URL",
        help="an S3-compatible store (MinIO, Ceph, CORTX, SeaweedFS); default: "
        "AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile, the fastload config",
    )
    store.add_argument("--profile", default=None, help="AWS profile (~/.aws/credentials)")
    store.add_argument(
        "--anonymous", action="store_true", help="public bucket: send no credentials"
    )
    _progress_flags(s)

    v = sub.add_parser(
        "verify",
        help="re-read a staged tree and compare it with its manifest",
        description="Re-read every file stage() put in DST and compare each chunk with "
        "the digests in its manifest. Exits 1 and lists what differs or is missing; the "
        "next 'fastload stage SRC DST' then re-copies exactly those files.",
    )
    v.add_argument("dst", help="a destination written by 'fastload stage'")
    v.add_argument("--engine", choices=["auto", "uring", "pread"], default="auto",
                   help="how files are read: io_uring or pread (default auto)")
    _progress_flags(v)

    ix = sub.add_parser(
        "index",
        help="index tar shards for random access, or describe an index (--info)",
        description="Scan the tar headers of SHARDS (paths, globs, webdataset brace "
        "ranges or directories) and write a shard index; or, with --info, describe one.",
    )
    ix.add_argument(
        "shards", nargs="*", metavar="SHARDS",
        help="tar shards: files, globs ('shard-*.tar'), brace ranges "
        "('shard-{000000..000099}.tar') or the folder 'fastload pack' wrote",
    )  # fmt: skip
    ix.add_argument("-o", "--output", metavar="INDEX", help="the index file to write")
    ix.add_argument("--info", metavar="INDEX", help="describe this index instead")
    ix.add_argument(
        "--on-duplicate",
        choices=["error", "first"],
        default="error",
        help="a key seen twice: fail (default) or keep the first sample",
    )
    ix.add_argument("--threads", type=int, default=None, help="shards scanned at once")

    pk = sub.add_parser(
        "pack",
        help="pack a tree, a tar or a tar of tars into indexed tar shards",
        description="Pack SRC (a directory tree: each file KEY.FIELD, ImageFolder class "
        "folders giving a 'cls' field; a tar; or a tar of tars such as ImageNet's train "
        "tar, read in one pass) into tar shards in OUT, with an index.",
    )
    pk.add_argument("src", help="a directory tree, a tar (.tar, .tar.gz, .tar.zst) or a "
                    "tar of tars")
    pk.add_argument(
        "out", help="the folder to write the shards and index.fidx in, or an object "
        "store prefix (s3://bucket/prefix/: written locally, then uploaded, the index last)"
    )
    pk.add_argument("--shuffle", action="store_true", help="a full random permutation")
    pk.add_argument("--seed", type=int, default=0, help="of the permutation (default 0)")
    pk.add_argument("--max-size", default="1GB", help="bytes per shard (default 1GB)")
    pk.add_argument("--max-count", type=int, default=None, help="samples per shard")
    pk.add_argument("--workers", type=int, default=None, help="threads reading and writing")
    pk.add_argument(
        "--pattern", default="shard-{:06d}.tar",
        help="the name of each shard file, a Python format string given the shard's "
        "number: shard-{:06d}.tar (default) names them shard-000000.tar, "
        "shard-000001.tar, ...; it must end in .tar",
    )  # fmt: skip
    pk.add_argument(
        "--task-index", type=int, default=None,
        help="this task (default: in a SLURM job array, this array task's place, else 0)",
    )  # fmt: skip
    pk.add_argument(
        "--num-tasks", type=int, default=None,
        help="tasks sharing the pack (default: the SLURM array's task count, else 1)",
    )  # fmt: skip
    pk.add_argument(
        "--classes", action=argparse.BooleanOptionalAction, default=None,
        help="add a 'cls' field per class folder (default: for ImageFolder layouts)",
    )  # fmt: skip
    _progress_flags(pk)

    e = sub.add_parser(
        "env",
        help="show the detected environment, this process's rank and the data paths",
        description="Show which environment fastload detects here (mila, drac, slurm, "
        "local, or a site plug-in), this process's node and rank, where data goes, what "
        "resolve() does with data larger than tmpdir (on_full), and where it put the data "
        "it resolved here, and why.",
    )
    e.add_argument("--json", action="store_true", help="print it as JSON")

    pr = sub.add_parser(
        "probe",
        help="measure the storage at PATH and say what fastload will do there",
        description="Measure, reading only and in under a minute, what the storage at PATH "
        "(a directory, a file or an s3:// URL) does: latency of stat/open/read, one stream "
        "and parallel throughput, the best number of requests in flight, io_uring, and "
        "the node-local destination's free space and file system.",
    )
    pr.add_argument("path", help="a directory, a file or s3://bucket/prefix/ to measure")
    pr.add_argument("--dest", default=None, help="node-local destination (default: tmpdir)")
    pr.add_argument("--seconds", type=float, default=20.0, help="time to spend (default 20)")
    pr.add_argument("--json", action="store_true", help="print it as JSON (versioned)")
    pr.add_argument("--endpoint-url", default=None, metavar="URL", help="s3: the endpoint")
    pr.add_argument("--profile", default=None, help="s3: AWS profile")
    pr.add_argument("--anonymous", action="store_true", help="s3: send no credentials")

    mx = sub.add_parser("mix", help="mixes of shard sets by weight (fastload.Mix)")
    mxs = mx.add_subparsers(dest="mix_command", required=True, metavar="COMMAND",
                            help="what to do with the mix")  # fmt: skip
    mp = mxs.add_parser(
        "plan",
        help="print a mix's epoch plan: samples per stream, per rank, per worker",
        description="Read the mix FILE.toml describes ([[streams]] with source and "
        "proportion, choose or repeat; world_size, num_workers, seed, ...) and print its "
        "next epoch's samples per stream, per rank and per DataLoader worker.",
    )
    mp.add_argument("file", help="the mix, a TOML file")
    mp.add_argument("--world-size", type=int, default=None, help="ranks (default: the file's)")
    mp.add_argument("--num-workers", type=int, default=None, help="workers per rank")
    mp.add_argument("--json", action="store_true", help="print it as JSON")
    return p
