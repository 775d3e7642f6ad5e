"""Only the leader holds the model (split/part_delivery.py): `ds4tp run` workers started without
--model receive their part into a parts cache and generate the unsplit model's tokens; the next
start sends nothing; a damaged cached file is fetched again; another share fetches its part.
A pair (dense float, 4-bit, mixture of experts, MLA: deepseek_v3; over RDMA, ucsim, the
link's bulk path) and three ranks (2:1:1), on 127.0.0.1 over TCP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tiny_models
from pairutil import free_port, reference_text

PROMPT = "Only one Mac needs the model"
TOKENS = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mlx_ds4tp.synthetic.tiny_model import LlamaSizes, save_llama, save_qwen3_moe

    root = tmp_path_factory.mktemp("part-models")
    return {
        "llama": save_llama(root / "llama", "tiny", seed=3),
        # Wider than "tiny": at 4 bits tiny's part is 162 KB, its files' headers (a name, dtype
        # and shape a tensor, three tensors a quantized weight) over 2% of it; here under 1%.
        "llama-q4": save_llama(root / "llama-q4", LlamaSizes(layers=2, hidden=256, heads=4, kv_heads=2,
                                                            intermediate=512, vocab=1024),
                               seed=5, quantization={"group_size": 32, "bits": 4}),
        "moe": save_qwen3_moe(root / "moe", "moe-tiny", seed=7),
        "llama8": save_llama(root / "llama8", "tiny8", seed=3),
        # MLA (latent attention, kv_b_proj cut by head) with routed and shared experts.
        "mla": tiny_models.build("deepseek_v3", root, seed=9),
    }


def run_group(procs, model_dir: Path, parts_dirs: list, extra=(), transport=("--transport", "tcp")) -> tuple:
    """One `ds4tp run` of 1 + len(parts_dirs) ranks, the workers without --model: (leader's stdout,
    leader's stderr, each worker's stderr)."""
    port = free_port()
    common = ["-m", "mlx_ds4tp", "run", "--max-tokens", str(TOKENS), "--no-chat-template", *transport]
    ranks = ["--ranks", str(1 + len(parts_dirs))] if len(parts_dirs) > 1 else []
    leader = procs.spawn(common + ["--model", str(model_dir), "--prompt", PROMPT, "--role", "leader",
                                   "--listen", "127.0.0.1", str(port), *ranks, *extra])
    workers = [procs.spawn(common + ["--role", "worker", "--coordinator", "127.0.0.1", str(port),
                                     "--parts-dir", str(d)]) for d in parts_dirs]
    lout, lerr = leader.communicate(timeout=300)
    werrs = [w.communicate(timeout=60)[1] for w in workers]
    assert leader.returncode == 0, lerr
    for w, err in zip(workers, werrs):
        assert w.returncode == 0, err
    return lout, lerr, werrs


def streamed(lout: str) -> str:
    return lout.rsplit("\n", 2)[0]


def entry_dirs(parts_dir: Path) -> list:
    return sorted(p for p in parts_dir.glob("*/*") if p.is_dir())


def weight_bytes(path: Path, pattern: str) -> int:
    return sum(f.stat().st_size for f in path.glob(pattern))


def part_data_bytes(entry: Path) -> tuple[int, int]:
    """(the part files' tensor bytes, their headers' bytes)."""
    data = header = 0
    for f in entry.glob("part-*.safetensors"):
        length = int.from_bytes(f.read_bytes()[:8], "little") + 8
        header += length
        data += f.stat().st_size - length
    return data, header


def held_bytes(model: Path, rank: int, size: int, split: str) -> int:
    """The weights' bytes load_split keeps on `rank`: the part a worker must receive."""
    from mlx.utils import tree_flatten

    from mlx_ds4tp.collectives.backend import cut_only_group
    from mlx_ds4tp.model_split import load_split

    loaded, _ = load_split(str(model), cut_only_group(rank, size), split=split)
    return sum(v.nbytes for _, v in tree_flatten(loaded.parameters()))


def assert_cache_holds_its_share(parts_dir: Path, model: Path, rank: int, size: int, split: str) -> None:
    """Issue 58's bound: a worker's whole parts cache holds at most its share of the weights'
    bytes (what load_split keeps on that rank) plus 2%, plus the tokenizer and config files (the
    model's own, its part's config and the cache's manifest)."""
    from mlx_ds4tp.split.part_plan import PART_CONFIG, plain_files

    plain = {f.name for f in plain_files(model)} | {PART_CONFIG, "manifest.json"}
    files = [f for f in parts_dir.rglob("*") if f.is_file()]
    weights = sum(f.stat().st_size for f in files if f.name not in plain)
    share = held_bytes(model, rank, size, split)
    print(f"rank {rank} of {size} ({split}): cache {weights} bytes beside config and tokenizer, share {share}")
    assert share <= weights <= share * 1.02, (weights, share)
    assert all(f.name in plain or f.name.startswith("part-") for f in files), files


@pytest.mark.parametrize("name", ["llama", "llama-q4", "moe", "mla"])
def test_pair_worker_without_model_gives_the_unsplit_tokens_then_reads_its_cache(procs, models, tmp_path, name):
    model = models[name]
    text, _ = reference_text(model, PROMPT, TOKENS)
    parts = tmp_path / "parts"
    lout, lerr, (werr,) = run_group(procs, model, [parts])
    assert streamed(lout) == text
    assert "receiving this rank's part" in werr and "holds its part from" in werr
    (entry,) = entry_dirs(parts)
    assert entry.name == "1of2-even"
    # Exactly its share of the weights, plus the files' headers (a tensor's name, dtype and shape
    # each: under 2% of a real model's part; tiny here), plus config and tokenizer.
    data, header = part_data_bytes(entry)
    assert data == held_bytes(model, 1, 2, "even") and header < 200 * 60
    assert_cache_holds_its_share(parts, model, 1, 2, "even")
    assert (entry / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    manifest = json.loads((entry / "manifest.json").read_text())
    assert set(manifest["files"]) == {p.name for p in entry.iterdir()} - {"manifest.json"}

    # The second start: the cache holds it all, no byte is sent.
    lout, lerr, (werr,) = run_group(procs, model, [parts])
    assert streamed(lout) == text
    assert "0.0 MB sent (its cache held all of it)" in lerr
    assert "receiving this rank's part" not in werr


def test_over_rdma_the_part_takes_the_links_bulk_path(procs, models, tmp_path):
    """--transport rdma (ucsim): the part's chunks travel as the RDMA link's exchanges, the
    control channel carrying the offer, each chunk's length and each file's digest; the worker
    gives the unsplit tokens, and its second start receives nothing."""
    model = models["moe"]
    text, _ = reference_text(model, PROMPT, TOKENS)
    parts = tmp_path / "parts"
    ucsim = ("--transport", "rdma", "--rdma-device", "ucsim")
    lout, lerr, (werr,) = run_group(procs, model, [parts], transport=ucsim)
    assert streamed(lout) == text and "transport rdma" in lout
    assert "over the RDMA bulk path" in lerr and "receiving this rank's part" in werr, lerr
    data, _ = part_data_bytes(entry_dirs(parts)[0])
    assert data == held_bytes(model, 1, 2, "even")
    lout, lerr, (werr,) = run_group(procs, model, [parts], transport=ucsim)
    assert streamed(lout) == text and "0.0 MB sent (its cache held all of it)" in lerr


def test_a_damaged_cached_file_is_fetched_again_and_another_split_fetches_its_part(procs, models, tmp_path):
    model = models["llama"]
    text, _ = reference_text(model, PROMPT, TOKENS)
    parts = tmp_path / "parts"
    run_group(procs, model, [parts])
    (entry,) = entry_dirs(parts)
    part = entry / "part-00001.safetensors"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit in the weights' bytes
    part.write_bytes(bytes(data))
    (entry / "foreign.bin").write_bytes(b"not of this part")

    lout, lerr, (werr,) = run_group(procs, model, [parts])
    assert streamed(lout) == text
    assert "part-00001.safetensors is damaged" in werr and "foreign.bin is not part of the offered part" in werr
    assert "receiving this rank's part: 1 file(s)" in werr
    assert not (entry / "foreign.bin").exists()

    # Another share: its own part, fetched beside the first.
    lout, lerr, (werr,) = run_group(procs, model, [parts], extra=["--split", "3:1"])
    assert streamed(lout) == text
    assert [e.name for e in entry_dirs(parts)] == ["1of2-3-1", "1of2-even"]
    assert "receiving this rank's part" in werr


@pytest.mark.parametrize("transport", ["tcp", "ucsim"])
def test_three_ranks_two_without_the_model_uneven_share(procs, models, tmp_path, transport):
    """Both workers are sent their parts at once over TCP (a thread a link), one after the other
    over their RDMA links' bulk paths (split/part_delivery.py)."""
    model = models["llama8"]
    text, _ = reference_text(model, PROMPT, TOKENS)
    dirs = [tmp_path / "w1", tmp_path / "w2"]
    flags = ("--transport", "tcp") if transport == "tcp" else ("--transport", "rdma", "--rdma-device", "ucsim")
    lout, lerr, werrs = run_group(procs, model, dirs, extra=["--split", "2:1:1"], transport=flags)
    assert streamed(lout) == text
    path = "over TCP" if transport == "tcp" else "over the RDMA bulk path"
    assert lerr.count(path) == 2 and lerr.count("MB sent") == 2, lerr
    ranks = set()
    for d, werr in zip(dirs, werrs):
        # The workers take ranks 1 and 2 in the order they joined: read which from the entry.
        (entry,) = entry_dirs(d)
        rank = int(entry.name.split("of")[0])
        assert entry.name == f"{rank}of3-2-1-1"
        ranks.add(rank)
        assert part_data_bytes(entry)[0] == held_bytes(model, rank, 3, "2:1:1")
        assert_cache_holds_its_share(d, model, rank, 3, "2:1:1")
        assert "holds its part from" in werr
    assert ranks == {1, 2}


def test_a_leader_without_model_is_refused_by_name(procs, tmp_path):
    proc = procs.spawn(["-m", "mlx_ds4tp", "run", "--prompt", "hi", "--role", "leader", "--listen",
                        "127.0.0.1", str(free_port())])
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "--model is required" in err and "--role worker" in err


def part_served_pair(model: Path, logs: Path, parts: Path, env=None, ranks: int = 2, extra=()):
    """`ds4tp serve`'s ranks (serveutil.ServedPair) with every worker started without --model
    (--parts-dir parts/NAME instead), again so when it is started again after kill()."""
    from serveutil import ServedPair

    class PartServedPair(ServedPair):
        def start(self, name, extra=()):
            cmd = self.cmds[name]
            if name != "leader" and "--model" in cmd:
                at = cmd.index("--model")
                del cmd[at: at + 2]
                cmd += ["--parts-dir", str(parts / name)]
            super().start(name, extra)

    logs.mkdir()
    return PartServedPair(model, logs, env=env, ranks=ranks, extra=list(extra))


def completion(pair) -> str:
    from serveutil import post_raw

    code, answer = post_raw(pair, "/v1/completions", json.dumps(
        {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}).encode())
    assert code == 200, answer
    return answer["choices"][0]["text"]


def test_serve_worker_without_model_answers_as_the_unsplit_model(models, tmp_path):
    parts = tmp_path / "parts"
    model = models["llama"]
    text, _ = reference_text(model, PROMPT, TOKENS)
    pair = part_served_pair(model, tmp_path / "logs", parts)
    try:
        pair.wait_healthy(within=180)
        assert completion(pair) == text
        pair.stop()
    finally:
        pair.close()
    assert "receiving this rank's part" in pair.log("worker")
    assert [e.name for e in entry_dirs(parts / "worker")] == ["1of2-even"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_restarted_serve_worker_without_model_rejoins_from_its_cache(models, tmp_path, ranks):
    """serve/rejoin.py's take-back: the serving leader offers the restarted worker its part as
    at a first start (lockstep.join_and_load.rejoin); its cache holds it all, so no byte is
    sent. At three ranks the other worker without --model, which kept running, follows the
    leader into the new group and declines the offer (it holds its part loaded). The ranks
    answer as the unsplit model again."""
    import time

    parts = tmp_path / "parts"
    model = models["llama" if ranks == 2 else "llama8"]
    victim = "worker" if ranks == 2 else "worker2"
    text, _ = reference_text(model, PROMPT, TOKENS)
    pair = part_served_pair(model, tmp_path / "logs", parts, env={"DS4_TP_TIMEOUT_SEC": "8"}, ranks=ranks)
    try:
        pair.wait_healthy(within=180)
        assert completion(pair) == text
        survivor = pair.procs["worker"].pid if ranks == 3 else None
        pair.kill(victim)
        deadline = time.monotonic() + 60
        while pair.health()[0] != 503:
            assert time.monotonic() < deadline, pair.log("leader")[-3000:]
            time.sleep(0.1)
        pair.start(victim)
        deadline = time.monotonic() + 180
        while pair.health()[0] != 200:
            assert pair.procs[victim].poll() is None, pair.log(victim)[-3000:]
            assert time.monotonic() < deadline, pair.log("leader")[-3000:] + pair.log(victim)[-3000:]
            time.sleep(0.2)
        assert completion(pair) == text
        if survivor is not None:
            assert pair.procs["worker"].pid == survivor and pair.procs["worker"].poll() is None
        pair.stop()
    finally:
        pair.close()
    leader, restarted = pair.log("leader"), pair.log(victim)
    assert "formed again" in leader and "0.0 MB sent (its cache held all of it)" in leader, leader
    assert leader.count("MB sent") == 2 * (ranks - 1), leader  # each worker's part at each forming
    assert restarted.count("receiving this rank's part") == 1, restarted
    assert restarted.count("holds its part from") == 2, restarted
    if ranks == 3:
        assert "joined a leader again" in pair.log("worker"), pair.log("worker")[-3000:]
        assert pair.log("worker").count("receiving this rank's part") == 1


def test_a_receiving_worker_peaks_no_higher_than_one_loading_its_part_from_disk(procs, tmp_path):
    """The 160M llama in float16 (a 162 MB part): the worker's peak RSS receiving its part, then
    loading it, against a worker loading the same part from the model's directory (+300 MB)."""
    import mlx.core as mx

    from mlx_ds4tp.synthetic.tiny_model import save_llama

    model = save_llama(tmp_path / "m150", "150m", seed=1, dtype=mx.float16)
    peaks = {}
    for how in ("disk", "received"):
        port, out = free_port(), tmp_path / f"{how}.json"
        common = ["-m", "mlx_ds4tp.cli.rank", "run", "--max-tokens", "2", "--no-chat-template", "--transport", "tcp"]
        leader = procs.spawn(common + ["--model", str(model), "--prompt", PROMPT, "--role", "leader",
                                       "--listen", "127.0.0.1", str(port)])
        own = ["--model", str(model)] if how == "disk" else ["--parts-dir", str(tmp_path / "parts")]
        worker = procs.spawn(common + own + ["--role", "worker", "--coordinator", "127.0.0.1", str(port),
                                             "--tokens-out", str(out)])
        _, lerr = leader.communicate(timeout=600)
        _, werr = worker.communicate(timeout=120)
        assert leader.returncode == 0 and worker.returncode == 0, lerr + werr
        peaks[how] = json.loads(out.read_text())["peak_rss_bytes"]
    assert "receiving this rank's part" in werr
    print("worker peak RSS (bytes):", peaks)
    assert peaks["received"] <= peaks["disk"] + 300e6, peaks


@pytest.mark.parametrize("transport", ["tcp", "ucsim"])
def test_a_leader_killed_mid_transfer_then_restarted_the_worker_resumes(procs, tmp_path, transport):
    """The leader stops after its first PART_DATA frame (the DS4_TP_TEST_PART_PAUSE_AFTER_BYTES
    hook: a known point, no timer) and is killed once the worker wrote those bytes; the worker
    exits with a clear error; both started again, the worker asks only for the rest of its part
    and the pair gives the unsplit model's tokens. Over TCP, and over RDMA (ucsim: the chunks on
    the link's bulk path)."""
    import re
    import signal
    import time

    from mlx_ds4tp.split.part_send import CHUNK_BYTES, TEST_PAUSE_ENV
    from mlx_ds4tp.synthetic.tiny_model import LlamaSizes, save_llama

    # Rank 1's half spans a few 4 MiB frames (about 17 MB), so the cut leaves most of it to send.
    sizes = LlamaSizes(layers=2, hidden=512, heads=8, kv_heads=4, intermediate=1024, vocab=4096)
    model = save_llama(tmp_path / "model", sizes, seed=13)
    text, _ = reference_text(model, PROMPT, TOKENS)
    parts = tmp_path / "parts"
    part = held_bytes(model, 1, 2, "even")
    assert part > 3 * CHUNK_BYTES

    port = free_port()
    flags = ("--transport", "tcp") if transport == "tcp" else ("--transport", "rdma", "--rdma-device", "ucsim")
    common = ["-m", "mlx_ds4tp", "run", "--max-tokens", str(TOKENS), "--no-chat-template", *flags]
    leader = procs.spawn(common + ["--model", str(model), "--prompt", PROMPT, "--role", "leader",
                                   "--listen", "127.0.0.1", str(port)], env={TEST_PAUSE_ENV: str(CHUNK_BYTES)})
    worker = procs.spawn(common + ["--role", "worker", "--coordinator", "127.0.0.1", str(port),
                                   "--parts-dir", str(parts)])
    # The worker has written the first frame of its part file: the transfer is cut mid-way.
    deadline = time.monotonic() + 300
    while not any(p.stat().st_size >= CHUNK_BYTES for p in parts.rglob("part-*.partial")):
        assert leader.poll() is None and worker.poll() is None, (leader.communicate(), worker.communicate())
        assert time.monotonic() < deadline, "the worker never received the first frame of its part"
        time.sleep(0.2)
    leader.send_signal(signal.SIGKILL)
    _, lerr = leader.communicate(timeout=60)
    assert f"{TEST_PAUSE_ENV}: test hook: this transfer stops after" in lerr
    # The worker does not hang on a dead leader: it ends with an error saying the leader is gone.
    _, werr = worker.communicate(timeout=120)
    assert worker.returncode != 0, werr
    assert "receiving this rank's part: 5 file(s)" in werr
    assert "the leader closed the connection while sending this rank's part" in werr
    assert "the next start resumes there" in werr
    (partial,) = parts.rglob("part-*.partial")
    kept = partial.stat().st_size
    assert kept >= CHUNK_BYTES

    # Both again: the worker resumes from what it kept, the leader sends the rest only.
    lout, lerr, (werr,) = run_group(procs, model, [parts], transport=flags)
    assert ("over the RDMA bulk path" in lerr) == (transport == "ucsim"), lerr
    assert streamed(lout) == text
    asked = re.search(r"receiving this rank's part: 1 file\(s\), ([0-9.]+) MB", werr)
    sent = re.search(r"rank 1's part: ([0-9.]+) MB sent", lerr)
    assert asked and sent, (lerr, werr)
    resent = float(sent.group(1)) * 1e6
    print(f"the restarted leader sent {resent / 1e6:.1f} MB of a {part / 1e6:.1f} MB part ({kept} bytes kept)")
    # The rest of the one cut file, nothing more (the logs round to 0.1 MB).
    assert resent < part - kept + 0.1e6 and abs(resent - float(asked.group(1)) * 1e6) < 0.1e6
    assert not list(parts.rglob("*.partial"))
    assert_cache_holds_its_share(parts, model, 1, 2, "even")
