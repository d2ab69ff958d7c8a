"""The fastload command line: stage datasets to node-local disk (from paths, archives and
s3:// URLs), verify them, index and pack tar shards, plan mixes of shard sets, and show
the environment."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Literal, Sequence

from .._util import human
from ..errors import FastloadError
from ..staging import StageResult, stage, verify
from .parser import _parser, _want_progress


def _mix_command(args: argparse.Namespace) -> int:
    import json

    from ..data.mixfile import format_plan, load_mix, plan_of

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

    from ..index import ShardIndex, expand_shards

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
            print(f"  stale: {_as_flags(str(e))}")
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
    from ..packing.folder import pack_path
    from ..packing.listing import CLS_FIELD
    from ..packing.options import PackOptions
    from ..packing.writer import DEFAULT_INDEX
    from ..sources import is_store_url

    if args.task_index is None:  # in a job array: its task (issue 23)
        from ..env.slurm import array_task

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


def _zip_options(args: argparse.Namespace) -> dict[str, Any] | None:
    opts = {"encoding": args.zip_encoding, "max_ratio": args.zip_max_ratio,
            "max_size": args.zip_max_size}  # fmt: skip
    return {k: v for k, v in opts.items() if v is not None} or None


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
    # Each sum is printed with its parts, the rest of it named, so that they add up:
    # until the copy's first progress report, the earlier stage is read, the source
    # opened and the copy started besides any listing and planning; after its last,
    # the journal is closed and the manifest written.
    setup, listing, planning, lock, copy, total = (round(t, 2) for t in (  # as printed
        st.setup_seconds, st.listing_seconds, st.planning_seconds, st.lock_wait_seconds,
        st.copy_seconds, st.seconds))  # fmt: skip
    print(f"  lock wait {lock:.2f} s, before the first progress {setup:.2f} s "
          f"(listing {listing:.2f} s, planning {planning:.2f} s, opening and starting "
          f"{max(0.0, setup - listing - planning):.2f} s), copying {copy:.2f} s, "
          f"committing {max(0.0, total - lock - setup - copy):.2f} s, total {total:.2f} s"
          )  # fmt: skip
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
            from ..staging.detached import stage_detached

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
                zip_options=_zip_options(args),
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
            from ..env.report import env_command

            return env_command(args.json)
        if args.command == "probe":
            import json

            from ..probing import ProbeEvent, format_table, probe

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
    except (FastloadError, OSError, ValueError, ImportError) as e:
        # ImportError: an optional dependency missing (obstore), naming its extra
        print(f"fastload: error: {_as_flags(str(e))}", file=sys.stderr)
        return 1
    return 2
