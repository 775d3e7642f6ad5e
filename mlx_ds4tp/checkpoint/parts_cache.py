"""A worker's parts cache: the files of its part of a model, as the leader sent them, kept for the
next start (default ~/.cache/mlx_ds4tp/parts/, --parts-dir to choose, --parts-max-gb to bound).

One entry a (model, share): <dir>/<the leader's fingerprint digest>/<rank>of<size>-<share>/, holding
the part's files and manifest.json, which names each whole file with its size and digest (the
leader's, checked against the bytes as they arrived). A file is kept only when it is in the
manifest, its size is the offered one and its digest, read again at every start, is the
manifest's: a damaged, foreign or partial file is never loaded, it is fetched again. A transfer
cut short leaves `NAME.partial`; the next one resumes it from its end (the whole file's digest
is checked when it is done, so a damaged prefix is caught there and the file fetched again).

The cache is bounded: before a part is received, the least recently used entries (other models
first, by age) are removed until the part fits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..base.log import log

DEFAULT_PARTS_DIR = Path("~/.cache/mlx_ds4tp/parts")
MANIFEST = "manifest.json"
PARTIAL = ".partial"
READ_BYTES = 16 << 20  # a file's digest is read this much at a time


DIGEST_NAME = "blake3"  # a digest's text starts with it, so one of another kind never matches


class PartDigest:
    """The one digest of a part's files, on both sides: BLAKE3, whose text is "blake3:" and its hex.
    It runs at 2.5x SHA-256's rate on one x86 core with SHA-NI here (4.4 against 1.7 GB/s) and,
    `spread`, spreads a large update over the machine's cores (its threads release the GIL), so
    checking a part's files keeps up with a Thunderbolt link. The name in the text keeps a cache
    written with another digest (SHA-256's bare hex, before) from ever matching: its files are
    fetched again, never trusted."""

    def __init__(self, spread: bool = True) -> None:
        try:
            import blake3
        except ImportError:
            raise ImportError("the parts cache checks files with BLAKE3: `pip install blake3` (a dependency "
                              "of mlx-ds4tp; reinstall it with pip)") from None
        self._hash = blake3.blake3(max_threads=blake3.blake3.AUTO if spread else 1)

    def update(self, data) -> None:
        self._hash.update(data)

    def hexdigest(self) -> str:
        return f"{DIGEST_NAME}:{self._hash.hexdigest()}"


def new_digest(spread: bool = True) -> PartDigest:
    return PartDigest(spread)


# A digest fed a part's bytes as they arrive spreads its updates over the cores only on a machine
# with this many: each update wakes the digest's pool threads, which spin a while for more work
# before they sleep; with idle cores that is free and the digest keeps up with a fast link, while
# on two cores (a worker and its leader on one machine, a small VM) the spinning took 0.2 CPU-s a
# GB from the receive and the write and the transfer ran slower than with one thread.
SPREAD_MIN_CORES = 4


def spread_as_arriving() -> bool:
    """Whether a digest fed bytes as they arrive (a received file's) spreads over the cores."""
    return (os.cpu_count() or 1) >= SPREAD_MIN_CORES


def file_digest(path: Path, upto: Optional[int] = None, spread: bool = True) -> PartDigest:
    """The digest state of a file's first `upto` bytes (all by default), read a chunk at a time
    into one buffer (a chunk large enough for the digest's threads to share)."""
    h = new_digest(spread)
    left = path.stat().st_size if upto is None else upto
    buffer = bytearray(READ_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while left > 0:
            n = f.readinto(view[: min(READ_BYTES, left)])
            if not n:
                break
            h.update(view[:n])
            left -= n
    return h


@dataclasses.dataclass(frozen=True)
class PartsSettings:
    """Where a worker without the model keeps its parts, and at most how many bytes they take
    (None: no bound)."""

    directory: Path = DEFAULT_PARTS_DIR
    max_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError(f"--parts-max-gb {self.max_bytes / 1e9:g}: give a size above 0 GB "
                             "(or leave it out: no bound)")

    @property
    def root(self) -> Path:
        return Path(self.directory).expanduser()


@dataclasses.dataclass(frozen=True)
class OfferedFile:
    """One file of a part as the leader offers it: its name, size, and its digest when the leader
    knows it before sending (config and tokenizer files), else "" (a part file's is known once
    its bytes are read: it comes with PART_END)."""

    name: str
    size: int
    digest: str = ""

    def check(self) -> None:
        if "/" in self.name or self.name in ("", ".", "..", MANIFEST) or self.name.endswith(PARTIAL):
            raise ValueError(f"the leader offered a file named {self.name!r}; a part's files are plain names")
        if self.size < 0:
            raise ValueError(f"the leader offered {self.name} of {self.size} bytes")


class PartEntry:
    """The cache entry of one (model, rank, size, share): what is there, what is missing, the
    writers of received files."""

    def __init__(self, settings: PartsSettings, model: str, rank: int, size: int, share: str):
        self.settings = settings
        self.path = settings.root / model / f"{rank}of{size}-{share}"
        self.manifest_path = self.path / MANIFEST

    def _manifest(self) -> Dict[str, dict]:
        try:
            doc = json.loads(self.manifest_path.read_text())
            return {str(k): v for k, v in doc["files"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def _record(self, name: str, size: int, digest: str) -> None:
        files = self._manifest()
        files[name] = {"size": size, "digest": digest}
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
        os.replace(tmp, self.manifest_path)

    def wanted(self, offered: List[OfferedFile]) -> List[Tuple[str, int]]:
        """(name, offset) of each offered file this entry lacks: absent, partial (the offset is
        what is there), damaged or of another digest (offset 0, the file removed). Every kept
        file's digest is read again here; files offered by no one are removed."""
        self.path.mkdir(parents=True, exist_ok=True)
        recorded = self._manifest()
        names = {f.name for f in offered}
        for stray in self.path.iterdir():
            base = stray.name[: -len(PARTIAL)] if stray.name.endswith(PARTIAL) else stray.name
            if stray.name != MANIFEST and base not in names:
                log(f"parts cache: {stray} is not part of the offered part; removed")
                _remove(stray)
        wanted = []
        for f in offered:
            file, partial = self.path / f.name, self.path / (f.name + PARTIAL)
            entry = recorded.get(f.name)
            if file.is_file():
                good = (entry is not None and entry.get("size") == f.size == file.stat().st_size
                        and (not f.digest or entry.get("digest") == f.digest)
                        and file_digest(file).hexdigest() == entry.get("digest"))
                if good:
                    continue
                log(f"parts cache: {file} is damaged, partial or of another part (its digest or size "
                    "is not the one received); fetched again")
                _remove(file)
            if partial.is_file() and partial.stat().st_size <= f.size:
                wanted.append((f.name, partial.stat().st_size))
            else:
                _remove(partial)
                wanted.append((f.name, 0))
        return wanted

    def writer(self, name: str, offset: int, size: int) -> "PartWriter":
        """The writer of `name` from `offset` (the bytes before it are this entry's partial file's)."""
        return PartWriter(self, name, offset, size)

    def bytes_held(self) -> int:
        return _tree_bytes(self.path)

    def touch(self) -> None:
        """Mark the entry used now (the bound removes the least recently used first)."""
        self.path.mkdir(parents=True, exist_ok=True)
        os.utime(self.path)

    def make_room(self, incoming: int) -> None:
        """Remove the least recently used other entries until this one, grown by `incoming`
        bytes, fits the bound. ValueError when the part alone is over it."""
        limit = self.settings.max_bytes
        if limit is None:
            return
        mine = self.bytes_held()
        if mine + incoming > limit:
            raise ValueError(f"this rank's part needs {(mine + incoming) / 1e9:.2f} GB and --parts-max-gb "
                             f"is {limit / 1e9:g}: raise --parts-max-gb or give more ranks a part")
        others = [e for e in self.settings.root.glob("*/*") if e.is_dir() and e != self.path]
        total = mine + incoming + sum(_tree_bytes(e) for e in others)
        # Oldest first; another model's entries before this model's other shares.
        others.sort(key=lambda e: (e.parent == self.path.parent, e.stat().st_mtime))
        for old in others:
            if total <= limit:
                break
            freed = _tree_bytes(old)
            log(f"parts cache: removed {old} ({freed / 1e9:.2f} GB, least recently used) to stay "
                f"under --parts-max-gb {limit / 1e9:g}")
            shutil.rmtree(old, ignore_errors=True)
            total -= freed
            if not any(old.parent.iterdir()):
                old.parent.rmdir()


class PartWriter:
    """One received file written as it arrives (NAME.partial, then NAME once its digest is the
    leader's): a few chunks in memory at most, never the file."""

    def __init__(self, entry: PartEntry, name: str, offset: int, size: int):
        self.entry, self.name, self.size = entry, name, size
        self.partial = entry.path / (name + PARTIAL)
        spread = spread_as_arriving()
        if offset:
            self.hash = file_digest(self.partial, offset, spread)  # the prefix a cut transfer left
        else:
            self.hash = new_digest(spread)
        self.file = open(self.partial, "r+b" if offset else "wb")
        if offset:
            # Only a resumed file: truncating a new one to 0 makes ext4 write the whole file out
            # when it is closed (its guard for files rewritten in place), 0.3 s a GB here.
            self.file.truncate(offset)
        self.file.seek(offset)
        self.done = offset

    def write(self, chunk: bytes) -> None:
        if self.done + len(chunk) > self.size:
            raise ValueError(f"the leader sent {self.name} past its offered {self.size} bytes")
        self.file.write(chunk)
        self.hash.update(chunk)
        self.done += len(chunk)

    def finish(self, digest: str) -> bool:
        """Close the file; keep it when whole and its digest is `digest` (the leader's), else
        remove it (False: it is fetched again)."""
        self.file.close()
        mine = self.hash.hexdigest()
        if self.done != self.size or mine != digest:
            log(f"parts cache: {self.name} arrived with digest {mine[:12]} and {self.done} bytes, the "
                f"leader's is {digest[:12]} and {self.size}; removed, fetched again")
            _remove(self.partial)
            return False
        os.replace(self.partial, self.entry.path / self.name)
        self.entry._record(self.name, self.size, digest)
        return True

    def abandon(self) -> None:
        """Keep what arrived as NAME.partial: the next transfer resumes there."""
        if not self.file.closed:
            self.file.flush()
            self.file.close()


def _remove(path: Path) -> None:
    try:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


__all__ = ["DEFAULT_PARTS_DIR", "DIGEST_NAME", "MANIFEST", "OfferedFile", "PartDigest", "PartEntry", "PartWriter",
           "PartsSettings", "file_digest", "new_digest", "spread_as_arriving"]
