"""The fastload command line: stage datasets to node-local disk (from paths, archives and
s3:// URLs), verify them, index and pack tar shards, plan mixes of shard sets, and show
the environment."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Literal, Sequence

from ._util import human, version
from .errors import FastloadError
from .staging import StageResult, stage, verify


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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
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
        "src", help="a file, a directory, an archive, s3://..., or - for a tar stream on "
        "stdin (plain, gzip or zstd: curl URL | fastload stage - DST)"
    )
    s.add_argument(
        "dst", help="the node-local directory (or file, for a file not unpacked) to write; "
        "made if missing, e.g. $SLURM_TMPDIR/data"
    )
    s.add_argument(
        "--include",
        action="append",
        default=None,
        metavar="GLOB",
        help="only paths matching GLOB (repeatable)",
    )
    s.add_argument(
        "--exclude",
        action="append",
        default=None,
        metavar="GLOB",
        help="leave out paths matching GLOB (repeatable)",
    )
    s.add_argument(
        "--engine", choices=["auto", "uring", "pread"], default="auto",
        help="how files are read and written: io_uring, or pread/pwrite in threads "
        "(default auto: io_uring where the kernel allows it, pread for a source on a "
        "network file system)",
    )  # fmt: skip
    s.add_argument("--workers", type=int, default=None,
                   help="files (or objects) in flight (default 64; 'fastload probe SRC' "
                   "measures what pays off)")
    s.add_argument("--stripe-size", type=int, default=None, help="bytes per stripe of big files")
    s.add_argument(
        "--nested",
        action="store_true",
        help="archives: also extract member tars, each into a directory named after it",
    )
    unpack = s.add_mutually_exclusive_group()
    unpack.add_argument(
        "--unpack",
        action="store_true",
        help="SRC must be a tar archive (.tar, .tar.gz, .tgz, .tar.zst): extract it",
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
        "local, or a site plug-in), this process's node and rank, and where data goes.",
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


def _mix_command(args: argparse.Namespace) -> int:
    import json

    from .data.mixfile import format_plan, load_mix, plan_of

    ds, world_size, workers = load_mix(args.file)
    world_size = world_size if args.world_size is None else args.world_size
    workers = workers if args.num_workers is None else args.num_workers
    if world_size < 1 or workers < 0:
        raise ValueError(f"--world-size must be >= 1 and --num-workers >= 0, not "
                         f"{world_size} and {workers}")  # fmt: skip
    plan = plan_of(ds, world_size, workers)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


def _index_command(args: argparse.Namespace) -> int:
    import glob
    import time

    from .index import ShardIndex, expand_shards

    if args.info:
        if args.shards or args.output:
            print("fastload: error: --info takes only an index file", file=sys.stderr)
            return 2
        idx = ShardIndex.open(args.info, check=False)
        info = idx.info()
        shard_bytes = sum(s.size for s in idx.shards)
        print(f"{info['path']}: fastload shard index, format version {info['version']}")
        print(f"  samples  {info['samples']}")
        print(f"  members  {info['members']}")
        print(f"  shards   {info['shards']} ({human(shard_bytes)})")
        print(f"  fields   {', '.join(idx.fields)}")
        print(f"  size     {human(info['file_size'])}")
        print(f"  on duplicate keys: {info['on_duplicate']}")
        try:
            idx.check()
        except (FastloadError, ValueError) as e:
            print(f"  stale: {e}")
            return 1
        print("  shards unchanged since indexing")
        return 0
    for s in args.shards:  # a plain path (no glob, no braces) that is not there
        if not glob.has_magic(s) and "{" not in s and not os.path.lexists(s):
            what = "directory" if len(args.shards) == 1 and not args.output else "file"
            print(
                f"fastload: error: no such {what}: '{s}' (give the folder 'fastload pack' "
                "wrote, or shard files with -o INDEX)",
                file=sys.stderr,
            )
            return 1
    if not args.output and len(args.shards) == 1 and os.path.isdir(args.shards[0]):
        args.output = os.path.join(args.shards[0], "index.fidx")  # a pack's folder
    if not args.shards or not args.output:
        print("fastload: error: index needs SHARDS and -o INDEX (or --info INDEX)", file=sys.stderr)
        return 2
    paths = [p for s in args.shards for p in expand_shards(s)]
    t0 = time.perf_counter()
    idx = ShardIndex.build(paths, args.output, on_duplicate=args.on_duplicate, threads=args.threads)
    dt = time.perf_counter() - t0
    total = sum(s.size for s in idx.shards)
    print(
        f"{idx.path}: {len(idx)} samples in {len(paths)} shards ({human(total)}), "
        f"fields {', '.join(idx.fields)}, in {dt:.2f} s"
    )
    return 0


def _pack_command(args: argparse.Namespace, progress: bool) -> int:
    """``fastload pack SRC OUT ...``."""
    from .packing.folder import pack_path
    from .packing.listing import CLS_FIELD
    from .packing.options import PackOptions
    from .packing.writer import DEFAULT_INDEX
    from .sources import is_store_url

    if args.task_index is None:  # in a job array: its task (issue 23)
        from .env.slurm import array_task

        args.task_index, n = array_task(os.environ, args.num_tasks) or (0, 1)
        args.num_tasks = n if args.num_tasks is None else args.num_tasks
    elif args.num_tasks is None:
        args.num_tasks = 1
    opts = PackOptions(
        pattern=args.pattern, max_size=args.max_size, max_count=args.max_count,
        shuffle=args.shuffle, seed=args.seed, workers=args.workers, index=DEFAULT_INDEX,
        progress=progress, sync=True, task_index=args.task_index, num_tasks=args.num_tasks,
    )  # fmt: skip
    r = pack_path(args.src, args.out, opts, classes=args.classes)
    rate = r.samples / r.seconds if r.seconds > 0 else 0.0
    mbs = r.bytes / r.seconds / 1e6 if r.seconds > 0 else 0.0
    who = f"task {args.task_index} of {args.num_tasks}: " if args.num_tasks > 1 else ""
    remote = is_store_url(args.out)
    where = r.out_dir  # into a bucket: its URL, ending in /
    print(
        f"{where}: {who}{r.samples} samples in {len(r.shards)} of {r.total_shards} shards "
        f"({human(r.bytes)}) in {r.seconds:.2f} s ({rate:,.0f} samples/s, {mbs:,.0f} MB/s)"
    )
    if r.classes is not None:
        print(f"  {len(r.classes)} classes (field '{CLS_FIELD}'), saved in classes.txt and .json")
    if r.skipped:
        print(f"  left out {r.skipped} files without KEY.FIELD names, e.g. {r.skipped_examples[0]}")
    if r.index is not None:
        print(f"  index {r.index}")
    elif args.num_tasks > 1 and remote:
        print("  no index: tasks packing into a bucket write none; pack with one task "
              "(--num-tasks 1) for shards with an index")
    elif args.num_tasks > 1:
        print(f"  when every task is done: fastload index {r.out_dir}")
    return 0


def _unpack(args: argparse.Namespace) -> bool | Literal["auto", "nested"]:
    if args.no_unpack:
        if args.nested:
            raise SystemExit("fastload stage: --nested and --no-unpack contradict each other")
        return False
    if args.nested:
        return "nested"
    return True if args.unpack else "auto"


def _storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    opts: dict[str, Any] = {}
    if args.endpoint_url:
        opts["endpoint_url"] = args.endpoint_url
    if args.profile:
        opts["profile"] = args.profile
    if args.anonymous:
        opts["anonymous"] = True
    return opts or None


# Hints in error messages that name Python arguments, and the flags that do the same.
_FLAGS = (
    ("pass on_special='skip'", "pass --skip-special"),
    ("pass unpack=False", "pass --no-unpack"),
    ("unpack=False", "--no-unpack"),
    ('pass on_duplicate="first"', "pass --on-duplicate first"),
    ("ShardIndex.open(path, rebuild=True) or `fastload index`", "`fastload index`"),
    ("pass checksum=", "pass --checksum "),
)


def _as_flags(message: str) -> str:
    """An error message with its Python-argument hints turned into this CLI's flags."""
    for python, flag in _FLAGS:
        message = message.replace(python, flag)
    return message


def _print_stage_stats(st: Any) -> None:
    """``fastload stage --stats``: the totals, then throughput about once a second."""
    print(f"  lock wait {st.lock_wait_seconds:.2f} s, listing and planning "
          f"{st.setup_seconds:.2f} s (listing {st.listing_seconds:.2f} s, planning "
          f"{st.planning_seconds:.2f} s), copying {st.copy_seconds:.2f} s, total "
          f"{st.seconds:.2f} s")  # fmt: skip
    if st.read_busy_seconds or st.write_busy_seconds:
        meta = (f", opens and closes {st.meta_busy_seconds:.2f} s" if st.meta_busy_seconds
                else "")  # fmt: skip
        print(f"  in flight: reads {st.read_busy_seconds:.2f} s, writes "
              f"{st.write_busy_seconds:.2f} s{meta} (summed over the threads)")  # fmt: skip
    print(f"  cpu {st.cpu_user_seconds:.2f} s user, {st.cpu_system_seconds:.2f} s system")
    why = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in sorted(st.retry_reasons.items()))
    print(f"  retries {st.retries}" + (f" ({why})" if why else ""))
    shown = -1.0
    for t, bps, fps in st.rates():
        if t - shown >= 1.0:
            shown = t
            print(f"  {t:7.2f} s  {human(bps)}/s  {fps:.0f} files/s")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "stage" and args.background:
            from .staging.background import stage_detached

            argv = list(sys.argv[1:] if argv is None else argv)
            return stage_detached(args.src, args.dst, [a if a != "--background" else "--serve"
                                                       for a in argv])  # fmt: skip
        if args.command == "stage":
            staged = stage(
                args.src,
                args.dst,
                include=args.include,
                exclude=args.exclude,
                engine=args.engine,
                workers=args.workers,
                stripe_size=args.stripe_size,
                on_special="skip" if args.skip_special else "error",
                unpack=_unpack(args),
                checksum=args.checksum,
                sync=args.sync,
                progress=_want_progress(args),
                storage_options=_storage_options(args),
                repair=args.repair,
                allow_empty=args.allow_empty,
                check_source="strict" if args.strict_source else True,
                fanout=args.fanout_transport or args.fanout,
                stats=args.stats,
                wait=not args.serve,  # --serve: the process --background started
            )
            r = staged if isinstance(staged, StageResult) else staged.wait()
            if r.skipped:
                print(f"{r.path}: already staged ({r.files} files, {human(r.bytes)})")
            else:
                rate = r.copied_bytes / r.seconds if r.seconds > 0 else 0.0
                print(
                    f"{r.path}: staged {r.copied_files} of {r.files} files, "
                    f"{human(r.copied_bytes)} in {r.seconds:.2f} s ({human(rate)}/s, "
                    f"engine {r.engine})"
                )
                if r.read_bytes is not None:
                    print(
                        f"{r.path}: fan-out over {r.nodes} nodes: this node read "
                        f"{human(r.read_bytes)} of the source"
                    )
            if r.stats is not None:
                _print_stage_stats(r.stats)
            return 0
        if args.command == "verify":
            res = verify(
                args.dst,
                engine=args.engine,
                progress=_want_progress(args),
            )
            for p in res.mismatched:
                print(f"differs: {p}")
            for p in res.missing:
                print(f"missing: {p}")
            if res.ok:
                print(f"{res.path}: {res.files} files verified, all match")
                return 0
            print(
                f"{res.path}: {len(res.mismatched)} differ, {len(res.missing)} missing; "
                "'fastload stage SRC DST' again re-copies exactly these",
                file=sys.stderr,
            )
            return 1
        if args.command == "index":
            return _index_command(args)
        if args.command == "pack":
            return _pack_command(args, _want_progress(args))
        if args.command == "mix":
            return _mix_command(args)
        if args.command == "env":
            from .env.report import env_command

            return env_command(args.json)
        if args.command == "probe":
            import json

            from .probing import ProbeEvent, format_table, probe

            def show(event: ProbeEvent) -> None:
                print(f"probe: {event.line}", file=sys.stderr, flush=True)

            found = probe(
                args.path,
                dest=args.dest,
                seconds=args.seconds,
                storage_options=_storage_options(args),
                on_event=None if args.json else show,
            )
            print(json.dumps(found.to_dict(), indent=2) if args.json else format_table(found))
            return 0
    except KeyboardInterrupt:
        print("fastload: interrupted (run the same command again to resume)", file=sys.stderr)
        return 130
    except (FastloadError, OSError, ValueError) as e:
        print(f"fastload: error: {_as_flags(str(e))}", file=sys.stderr)
        return 1
    return 2
