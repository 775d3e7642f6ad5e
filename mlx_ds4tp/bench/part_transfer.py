"""A worker's part sent by the leader (split/part_send.py) against a plain socket copy of the same
bytes, on 127.0.0.1, in one run: the rate of each, the receiver's peak RSS, and the second
start (the cache read and every digest checked, nothing sent). The leader runs here; each
receiver is a child process, as a worker is.

    python -m mlx_ds4tp.bench.part_transfer [--model DIR] [--split even] [--ranks 2]
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
    t0 = time.perf_counter()
    entry = receive_part(link, rank, size, SplitShare.of(share), PartsSettings(Path(parts_dir)))
    return {"seconds": time.perf_counter() - t0, "entry": str(entry)}


def _receive_plain(port: int, out: str, nbytes: int) -> dict:
    from ..link.control import dial

    sock = dial("127.0.0.1", port, time.monotonic() + 60, "plain")
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(out, "wb") as f:
        left = nbytes
        while left:
            n = sock.recv_into(view[: min(CHUNK, left)])
            if not n:
                raise SystemExit("plain copy: the sender closed early")
            f.write(view[:n])
            left -= n
    return {"seconds": time.perf_counter() - t0}


def _child(argv: List[str]) -> int:
    kind, *rest = argv
    if kind == "part":
        record = _receive_part(int(rest[0]), rest[1], rest[2], int(rest[3]), int(rest[4]), rest[5])
    else:
        record = _receive_plain(int(rest[0]), rest[1], int(rest[2]))
    rss_unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    record["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * rss_unit
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


def _send_part(model: Path, parts_dir: Path, rank: int, size: int, share: str) -> dict:
    from ..link.control import ControlChannel
    from ..link.fingerprint import model_fingerprint
    from ..split.part_receive import stated_fingerprint
    from ..split.part_send import PartSender
    from ..split.share import SplitShare

    summary = model_fingerprint(model).summary()
    listener = _listen()
    child = _spawn(["part", str(listener.getsockname()[1]), str(parts_dir), summary.hex(), str(rank), str(size), share])
    sock, _ = listener.accept()
    t0 = time.perf_counter()
    sender = PartSender(model, rank, size, SplitShare.of(share), stated_fingerprint(summary))
    t1 = time.perf_counter()  # the plan made (no weight read): from here on, the offer and the bytes
    sent = sender.send(ControlChannel(sock, 600.0))
    seconds = time.perf_counter() - t1
    out, _ = child.communicate(timeout=600)
    record = json.loads(out.strip().splitlines()[-1])
    return {"sent_bytes": sent, "send_seconds": seconds, "plan_seconds": t1 - t0, **record}


def _send_plain(files: List[Path], out: Path) -> dict:
    nbytes = sum(f.stat().st_size for f in files)
    listener = _listen()
    child = _spawn(["plain", str(listener.getsockname()[1]), str(out), str(nbytes)])
    sock, _ = listener.accept()
    buf = bytearray(CHUNK)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                sock.sendall(memoryview(buf)[:n])
    outp, _ = child.communicate(timeout=600)
    sock.close()
    return {"sent_bytes": nbytes, **json.loads(outp.strip().splitlines()[-1])}


def main(argv: List[str]) -> int:
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    p = argparse.ArgumentParser(prog="python -m mlx_ds4tp.bench.part_transfer")
    p.add_argument("--model", default=None, help="a model directory (default: a random 150M llama, float16)")
    p.add_argument("--split", default="even")
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.model is None:
            import mlx.core as mx

            from ..synthetic.tiny_model import save_llama

            model = save_llama(root / "model", "150m", seed=1, dtype=mx.float16)
        else:
            model = Path(args.model)
        rank = args.ranks - 1
        first = _send_part(model, root / "parts", rank, args.ranks, args.split)
        entry = Path(first["entry"])
        files = sorted(f for f in entry.iterdir() if f.name != "manifest.json")
        plain = _send_plain(files, root / "plain.bin")
        second = _send_part(model, root / "parts", rank, args.ranks, args.split)
        part_mb = sum(f.stat().st_size for f in files) / 1e6
        report = {
            "part_mb": round(part_mb, 1),
            "part_transfer_mb_s": round(first["sent_bytes"] / 1e6 / first["send_seconds"], 1),
            "part_plan_s": round(first["plan_seconds"], 2),
            "plain_socket_mb_s": round(plain["sent_bytes"] / 1e6 / plain["seconds"], 1),
            "part_receiver_peak_rss_mb": round(first["peak_rss_bytes"] / 1e6, 1),
            "plain_receiver_peak_rss_mb": round(plain["peak_rss_bytes"] / 1e6, 1),
            "second_start_s": round(second["seconds"], 2),  # the worker's whole receive_part
            "second_start_sent_bytes": second["sent_bytes"],
        }
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
