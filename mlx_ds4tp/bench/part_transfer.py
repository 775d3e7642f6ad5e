"""A worker's part sent by the leader (split/part_send.py) against a plain socket copy of the same
bytes, on 127.0.0.1, in one run: the rate of each, the receiver's peak RSS, and the second
start (the cache read and every digest checked, nothing sent). The leader runs here; each
receiver is a child process, as a worker is.

    python -m mlx_ds4tp.bench.part_transfer [--model DIR | --size 150m|1b] [--split even] [--ranks 2] [--runs 5]

Each run alternates: the part sent into a fresh cache by a leader that has not sent it before
(its memo forgotten: the cut traced, every file hashed), the plain copy, the plain copy with the
part's digest taken on both sides (the floor a digest-checked transfer can reach on these CPUs),
then the part sent again into another fresh cache (a second worker, a resume: the leader's memo
holds the trace and the digests), then once more by a leader started again (its memo in memory
gone, its memo file on disk kept: split/part_memo_file.py); the medians and the medians of the
per-run ratios are reported. The leader's memo files go to a directory of the bench's own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import List

CHUNK = 4 << 20


def _receive_part(port: int, parts_dir: str, summary_hex: str, rank: int, size: int, share: str) -> dict:
    from ..checkpoint.parts_cache import PartsSettings
    from ..link.control import ControlChannel, dial
    from ..split.part_receive import receive_part
    from ..split.share import SplitShare

    sock = dial("127.0.0.1", port, time.monotonic() + 60, "part")
    link = types.SimpleNamespace(control=ControlChannel(sock, 600.0),
                                 peer_hello=types.SimpleNamespace(fingerprint=bytes.fromhex(summary_hex)))
    record = {"cpu_before": time.process_time()}
    t0 = time.perf_counter()
    entry = receive_part(link, rank, size, SplitShare.of(share), PartsSettings(Path(parts_dir)))
    return {**record, "seconds": time.perf_counter() - t0, "entry": str(entry)}


def _receive_plain(port: int, out: str, nbytes: int, hashed: bool) -> dict:
    from ..checkpoint.parts_cache import new_digest, spread_as_arriving
    from ..link.control import dial

    sock = dial("127.0.0.1", port, time.monotonic() + 60, "plain")
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    digest = new_digest(spread_as_arriving())
    record = {"cpu_before": time.process_time()}
    t0 = time.perf_counter()
    with open(out, "wb") as f:
        left = nbytes
        while left:
            n = sock.recv_into(view[: min(CHUNK, left)])
            if not n:
                raise SystemExit("plain copy: the sender closed early")
            f.write(view[:n])
            if hashed:
                digest.update(view[:n])
            left -= n
    return {**record, "seconds": time.perf_counter() - t0}


def _peak_rss(usage: resource.struct_rusage) -> int:
    """This process's peak resident bytes. Linux keeps ru_maxrss across fork and exec (a child
    of this bench, which built the model, would report the bench's peak): VmHWM is this
    process's own; macOS's ru_maxrss is its own, in bytes."""
    if sys.platform == "darwin":
        return usage.ru_maxrss
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return usage.ru_maxrss * 1024


def _child(argv: List[str]) -> int:
    kind, *rest = argv
    if kind == "part":
        record = _receive_part(int(rest[0]), rest[1], rest[2], int(rest[3]), int(rest[4]), rest[5])
    else:
        record = _receive_plain(int(rest[0]), rest[1], int(rest[2]), kind == "hashed")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record["peak_rss_bytes"] = _peak_rss(usage)
    record["cpu_seconds"] = usage.ru_utime + usage.ru_stime - record.pop("cpu_before")
    print(json.dumps(record))
    return 0


def _spawn(args: List[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mlx_ds4tp.bench.part_transfer", "--child", *args],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ))


def _listen() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    return listener


def _settle() -> None:
    """The disk's writes of the transfers before written out: each transfer starts with none of
    theirs still queued (the kernel would write them during this one, and the one measured
    right after another would pay for both)."""
    os.sync()


def _send_part(model: Path, parts_dir: Path, rank: int, size: int, share: str) -> dict:
    from ..link.control import ControlChannel
    from ..link.fingerprint import model_fingerprint
    from ..split.part_receive import stated_fingerprint
    from ..split.part_send import PartSender
    from ..split.share import SplitShare

    summary = model_fingerprint(model).summary()
    _settle()
    listener = _listen()
    child = _spawn(["part", str(listener.getsockname()[1]), str(parts_dir), summary.hex(), str(rank), str(size), share])
    sock, _ = listener.accept()
    t0 = time.perf_counter()
    sender = PartSender(model, rank, size, SplitShare.of(share), stated_fingerprint(summary))
    t1 = time.perf_counter()  # the plan made (no weight read): from here on, the offer and the bytes
    cpu = time.process_time()
    sent = sender.send(ControlChannel(sock, 600.0))
    seconds = time.perf_counter() - t1
    cpu = time.process_time() - cpu
    out, _ = child.communicate(timeout=600)
    record = json.loads(out.strip().splitlines()[-1])
    return {"sent_bytes": sent, "send_seconds": seconds, "plan_seconds": t1 - t0, "send_cpu_seconds": cpu, **record}


def _send_plain(files: List[Path], out: Path, hashed: bool) -> dict:
    """The same bytes read from disk and sent over a socket a chunk at a time, written to disk
    on the other side; `hashed`: each side also takes the part's digest of them, as the part's does."""
    from ..checkpoint.parts_cache import new_digest, spread_as_arriving

    nbytes = sum(f.stat().st_size for f in files)
    _settle()
    listener = _listen()
    child = _spawn(["hashed" if hashed else "plain", str(listener.getsockname()[1]), str(out), str(nbytes)])
    sock, _ = listener.accept()
    buf = bytearray(CHUNK)
    digest = new_digest(spread_as_arriving())
    cpu = time.process_time()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                if hashed:
                    digest.update(memoryview(buf)[:n])
                sock.sendall(memoryview(buf)[:n])
    cpu = time.process_time() - cpu
    outp, _ = child.communicate(timeout=600)
    sock.close()
    return {"sent_bytes": nbytes, "send_cpu_seconds": cpu, **json.loads(outp.strip().splitlines()[-1])}


def _model(root: Path, size: str) -> Path:
    import mlx.core as mx

    from ..synthetic.tiny_model import LlamaSizes, save_llama

    sizes = {"150m": "150m",
             "1b": LlamaSizes(layers=16, hidden=2048, heads=16, kv_heads=8, intermediate=5632, vocab=32000)}
    return save_llama(root / "model", sizes[size], seed=1, dtype=mx.float16)


def _median(values: List[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def main(argv: List[str]) -> int:
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    p = argparse.ArgumentParser(prog="python -m mlx_ds4tp.bench.part_transfer")
    p.add_argument("--model", default=None, help="a model directory (default: a random llama, float16, "
                   "of --size)")
    p.add_argument("--size", choices=("150m", "1b"), default="150m",
                   help="the random llama's size when no --model: 150m (a 162 MB part), 1b (1.1 GB)")
    p.add_argument("--split", default="even")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--runs", type=int, default=5, help="runs of each, alternating; medians reported")
    args = p.parse_args(argv)
    from ..split.part_memo import forget_parts
    from ..split.part_memo_file import MEMO_DIR_ENV, memo_dir

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ[MEMO_DIR_ENV] = str(root / "leader-memo")  # the leader's memo files: the bench's own
        model = _model(root, args.size) if args.model is None else Path(args.model)
        rank = args.ranks - 1
        parts, warms, restarts, plains, hashed, firsts, cpus = [], [], [], [], [], [], []
        for run in range(args.runs):
            # A fresh cache each transfer: every one sends the whole part.
            forget_parts()
            _remove_tree(memo_dir())  # a leader that never sent this part
            first = _send_part(model, root / f"parts{run}", rank, args.ranks, args.split)
            firsts.append(first)
            parts.append(first["sent_bytes"] / first["send_seconds"])
            entry = Path(first["entry"])
            files = sorted(f for f in entry.iterdir() if f.name != "manifest.json")
            # Each copy into a file of its own, as each part goes into a fresh cache: a file
            # rewritten in place reuses its pages and is written faster than a new one.
            plain = _send_plain(files, root / f"plain{run}.bin", hashed=False)
            plains.append(plain["sent_bytes"] / plain["seconds"])
            hashed_plain = _send_plain(files, root / f"hashed{run}.bin", hashed=True)
            hashed.append(hashed_plain["sent_bytes"] / hashed_plain["seconds"])
            (root / f"plain{run}.bin").unlink()
            (root / f"hashed{run}.bin").unlink()
            # After the plain copies, so that they run as they did before the memo (a file
            # written right after another was removed is written faster here: freed pages).
            warm = _send_part(model, root / f"warm{run}", rank, args.ranks, args.split)
            firsts.append(warm)
            warms.append(warm["sent_bytes"] / warm["send_seconds"])
            _remove_tree(root / f"warm{run}")
            forget_parts()  # a leader started again: its memo file read, nothing traced or hashed
            restarted = _send_part(model, root / f"restarted{run}", rank, args.ranks, args.split)
            restarts.append(restarted["sent_bytes"] / restarted["send_seconds"])
            _remove_tree(root / f"restarted{run}")
            cpus.append((first["send_cpu_seconds"], first["cpu_seconds"], warm["send_cpu_seconds"],
                         warm["cpu_seconds"], plain["send_cpu_seconds"], plain["cpu_seconds"],
                         restarted["send_cpu_seconds"], restarted["plan_seconds"],
                         hashed_plain["send_cpu_seconds"], hashed_plain["cpu_seconds"]))
            if run < args.runs - 1:
                _remove_tree(root / f"parts{run}")
        forget_parts()  # the second start: both sides started again, the leader's memo gone
        second = _send_part(model, root / f"parts{args.runs - 1}", rank, args.ranks, args.split)
        part_mb = sum(f.stat().st_size for f in files) / 1e6

        def per_gb(i: int) -> float:
            return round(_median([c[i] for c in cpus]) / part_mb * 1e3, 2)

        report = {
            "part_mb": round(part_mb, 1),
            "runs": args.runs,
            "part_transfer_mb_s": round(_median(parts) / 1e6, 1),
            "part_again_mb_s": round(_median(warms) / 1e6, 1),
            "plain_socket_mb_s": round(_median(plains) / 1e6, 1),
            "part_over_plain": round(_median([a / b for a, b in zip(parts, plains)]), 2),
            "part_again_over_plain": round(_median([a / b for a, b in zip(warms, plains)]), 2),
            "part_restarted_over_plain": round(_median([a / b for a, b in zip(restarts, plains)]), 2),
            "plain_digest_both_sides_mb_s": round(_median(hashed) / 1e6, 1),
            "part_over_plain_digest": round(_median([a / b for a, b in zip(parts, hashed)]), 2),
            # CPU seconds a GB on each side (sender, receiver), the part's (first, again) and the
            # plain copy's: what a machine with cores to spare overlaps, and a busy one cannot.
            "part_cpu_s_per_gb": [per_gb(0), per_gb(1)],
            "part_again_cpu_s_per_gb": [per_gb(2), per_gb(3)],
            "part_restarted_cpu_s_per_gb": per_gb(6),  # the leader's
            "plain_cpu_s_per_gb": [per_gb(4), per_gb(5)],
            "plain_digest_cpu_s_per_gb": [per_gb(8), per_gb(9)],  # both sides hashing too
            "part_plan_s": round(_median([f["plan_seconds"] for f in firsts[::2]]), 2),
            "part_restarted_plan_s": round(_median([c[7] for c in cpus]), 2),  # the memo file read
            "part_receiver_peak_rss_mb": round(max(f["peak_rss_bytes"] for f in firsts) / 1e6, 1),
            "plain_receiver_peak_rss_mb": round(plain["peak_rss_bytes"] / 1e6, 1),
            "second_start_s": round(second["seconds"], 2),  # the worker's whole receive_part
            "second_start_sent_bytes": second["sent_bytes"],
        }
        print(json.dumps(report))
    return 0


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
