"""Listing a source to pack and grouping its files into samples: a tree's regular files
(parallel native walk) or an archive's members (headers only; member tars listed in
parallel), grouped by webdataset's key rule, with a ``cls`` member per sample for
ImageFolder layouts."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .. import _core
from ..staging import archive_compression
from .plan import split_key

CLS_FIELD = "cls"
_SKIPPED_EXAMPLES = 8


@dataclasses.dataclass
class Listing:
    """A source's regular files (tree) or members (archive), in source order."""

    kind: str  # "tree" | "tar"
    path: Path
    names: list[str]  # relative paths: tar member names in the shards
    offsets: npt.NDArray[np.uint64]  # of the data in the archive (zeros for a tree)
    sizes: npt.NDArray[np.uint64]
    skipped: int = 0
    skipped_examples: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Samples:
    """Members grouped into samples, sorted by sample then field."""

    keys: list[str]  # per sample
    first: npt.NDArray[np.int64]  # per sample: its first member
    count: npt.NDArray[np.int64]  # per sample: its members
    src: npt.NDArray[np.int64]  # per member: listing index, or -1 (inline)
    off: npt.NDArray[np.uint64]  # per member: data offset in the archive or in inline
    size: npt.NDArray[np.uint64]
    name_off: npt.NDArray[np.uint64]  # per member: its name in `names`
    name_len: npt.NDArray[np.uint32]
    names: bytes  # the listing's names, then the inline members' names
    src_offsets: npt.NDArray[np.uint64]  # the listing's names in `names` (tree sources)
    inline: bytes
    classes: list[str] | None
    skipped: int
    skipped_examples: list[str]


def _hidden(name: str) -> bool:
    return name.startswith(".") or "/." in name


def list_source(src: Path, out_dir: Path, threads: int) -> Listing:
    """The files of a tree or the members of an archive."""
    st = os.stat(src)  # FileNotFoundError names the path
    if os.path.isdir(src):
        return _list_tree(src, out_dir, threads)
    kind = archive_compression(src)
    if kind in ("gzip", "zstd"):
        raise ValueError(f"'{src}' is a {kind}-compressed archive: decompress it first")
    if kind is None:
        raise ValueError(f"'{src}' is neither a directory nor a tar archive")
    del st
    names, offsets, sizes, info = _core.list_archive(src, True, threads)
    return Listing(
        "tar",
        src,
        names,
        offsets,
        sizes,
        int(info["skipped"]),
        [str(x) for x in info["skipped_examples"]],
    )


def _list_tree(root: Path, out_dir: Path, threads: int) -> Listing:
    # The walk's columns (no Python object per entry), then a name per file packed.
    cols = _core.walk_columns(root, [], [], True, threads)
    # The output folder inside the source (a re-run) is not part of the data.
    try:
        inside = os.path.relpath(os.path.realpath(out_dir), os.path.realpath(root))
    except ValueError:
        inside = ".."
    exclude = None if inside.startswith("..") else inside + "/"
    kinds = np.frombuffer(cols["kind"], dtype=np.uint8)
    offsets = np.frombuffer(cols["offsets"], dtype=np.int64).tolist()
    all_sizes = np.frombuffer(cols["size"], dtype=np.int64)
    paths: bytes = cols["paths"]
    names: list[str] = []
    sizes: list[int] = []
    skipped = [str(x) for x in cols["skipped"]]
    for i in np.flatnonzero(kinds != 1).tolist():  # directories are not packed
        path = os.fsdecode(paths[offsets[i] : offsets[i + 1]])
        if exclude is not None and (path + "/").startswith(exclude):
            continue
        size = int(all_sizes[i])
        if kinds[i] == 2:  # symlink inside the tree: packed as the file it points to
            try:
                st = os.stat(root / path)
            except OSError:
                skipped.append(path)
                continue
            if not os.path.isfile(root / path):
                skipped.append(path)
                continue
            size = st.st_size
        names.append(path)
        sizes.append(size)
    return Listing(
        "tree",
        root,
        names,
        np.zeros(len(names), dtype=np.uint64),
        np.array(sizes, dtype=np.uint64),
        len(skipped),
        skipped[:_SKIPPED_EXAMPLES],
    )


def _blob(names: Sequence[str]) -> tuple[bytes, npt.NDArray[np.uint64]]:
    """The names' bytes joined, and offsets (len + 1) into them."""
    joined = "".join(names)
    blob = os.fsencode(joined)
    if len(blob) == len(joined):  # ASCII: byte lengths are character lengths
        lens = np.fromiter(map(len, names), dtype=np.uint64, count=len(names))
    else:
        parts = [os.fsencode(n) for n in names]
        lens = np.fromiter(map(len, parts), dtype=np.uint64, count=len(parts))
    offsets = np.zeros(len(names) + 1, dtype=np.uint64)
    np.cumsum(lens, out=offsets[1:])
    return blob, offsets


def group(listing: Listing, classes: bool | None) -> Samples:
    """Groups members into samples: key and field by webdataset's rule, samples in key
    order (a tree) or archive order (an archive), fields sorted within a sample."""
    keys: dict[str, int] = {}
    m_listed: list[int] = []
    m_sample: list[int] = []
    m_field: list[str] = []
    skipped = listing.skipped
    examples = list(listing.skipped_examples)
    for i, name in enumerate(listing.names):
        kf = None if _hidden(name) else split_key(name)
        if kf is None:
            skipped += 1
            if len(examples) < _SKIPPED_EXAMPLES:
                examples.append(name)
            continue
        s = keys.get(kf[0])
        if s is None:
            s = keys[kf[0]] = len(keys)
        m_listed.append(i)
        m_sample.append(s)
        m_field.append(kf[1])
    key_list = list(keys)
    n = len(key_list)
    if listing.kind == "tree":
        by_key = sorted(range(n), key=key_list.__getitem__)
        rank = np.empty(n, dtype=np.int64)
        rank[np.array(by_key, dtype=np.int64)] = np.arange(n, dtype=np.int64)
        key_list = [key_list[i] for i in by_key]
    else:
        rank = np.arange(n, dtype=np.int64)

    # Classes: every key inside a top-level folder, two folders or more.
    class_names: list[str] | None = None
    if classes is not False:
        tops = {k.split("/", 1)[0] for k in key_list if "/" in k}
        flat = any("/" not in k for k in key_list)
        has_cls = CLS_FIELD in set(m_field)
        if not flat and len(tops) >= 2 and not has_cls:
            class_names = sorted(tops)
        elif classes:
            why = (
                f"samples already have a '{CLS_FIELD}' field"
                if has_cls
                else "keys must all lie in two or more top-level folders (ImageFolder)"
            )
            raise ValueError(f"cannot add classes to '{listing.path}': {why}")

    blob, src_offsets = _blob(listing.names)
    listed = np.array(m_listed, dtype=np.int64)
    sample = rank[np.array(m_sample, dtype=np.int64)] if m_sample else np.zeros(0, np.int64)
    src = listed if listing.kind == "tree" else np.zeros(len(listed), dtype=np.int64)
    off = listing.offsets[listed] if len(listed) else np.zeros(0, np.uint64)
    size = listing.sizes[listed] if len(listed) else np.zeros(0, np.uint64)
    name_off = src_offsets[listed] if len(listed) else np.zeros(0, np.uint64)
    name_len = (src_offsets[listed + 1] - src_offsets[listed]) if len(listed) else name_off
    fields = list(m_field)
    inline = b""
    if class_names is not None:
        # One inline member KEY.cls per sample, its data the class position as text.
        text = [str(i) for i in range(len(class_names))]
        inline = "".join(text).encode("ascii")
        cls_off = np.zeros(len(text) + 1, dtype=np.uint64)
        np.cumsum([len(t) for t in text], out=cls_off[1:])
        cls_of = {c: i for i, c in enumerate(class_names)}
        sample_cls = np.array([cls_of[k.split("/", 1)[0]] for k in key_list], dtype=np.int64)
        cls_names = [f"{k}.{CLS_FIELD}" for k in key_list]
        cblob, coffs = _blob(cls_names)
        base = len(blob)
        blob += cblob
        sample = np.concatenate([sample, np.arange(n, dtype=np.int64)])
        src = np.concatenate([src, np.full(n, -1, dtype=np.int64)])
        off = np.concatenate([off, cls_off[sample_cls]])
        size = np.concatenate([size, (cls_off[sample_cls + 1] - cls_off[sample_cls])])
        name_off = np.concatenate([name_off, coffs[:-1] + np.uint64(base)])
        name_len = np.concatenate([name_len, coffs[1:] - coffs[:-1]])
        fields += [CLS_FIELD] * n

    # Members sorted by sample, then field (byte order, as sorted() of str sorts).
    if len(fields) == n:
        order = np.argsort(sample, kind="stable")
    else:
        uniq = sorted(set(fields))
        code = {f: i for i, f in enumerate(uniq)}
        fcode = np.fromiter((code[f] for f in fields), dtype=np.int64, count=len(fields))
        order = np.lexsort((fcode, sample))
        dup = (sample[order][1:] == sample[order][:-1]) & (fcode[order][1:] == fcode[order][:-1])
        if dup.any():
            j = int(order[int(np.argmax(dup)) + 1])
            raise ValueError(
                f"'{listing.path}': two members named "
                f"'{key_list[int(sample[j])]}.{fields[j]}'"
            )
    sample = sample[order]
    count = np.bincount(sample, minlength=n).astype(np.int64)
    first = np.zeros(n, dtype=np.int64)
    np.cumsum(count[:-1], out=first[1:])
    return Samples(
        keys=key_list,
        first=first,
        count=count,
        src=src[order],
        off=np.asarray(off, dtype=np.uint64)[order],
        size=np.asarray(size, dtype=np.uint64)[order],
        name_off=np.asarray(name_off, dtype=np.uint64)[order],
        name_len=np.asarray(name_len, dtype=np.uint32)[order],
        names=blob,
        src_offsets=src_offsets,
        inline=inline,
        classes=class_names,
        skipped=skipped,
        skipped_examples=examples,
    )

