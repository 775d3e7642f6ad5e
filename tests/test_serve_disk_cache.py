"""`ds4tp serve --prompt-cache-dir`: prompt caches on disk, each rank its own half, a restart
served from them exactly; damaged, foreign and missing files skipped and recomputed; the
directory bounded; a full disk logged; a quantized, a rotating and a recurrent cache each served
from disk as a cold server answers (lockstep/caches/disk_cache.py, serve/engine/admission.py)."""

from __future__ import annotations

import errno
import json
import os
import shutil

import numpy as np
import pytest

from serveutil import ServedPair, build_chat_model, post_raw, reference


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("disk-model"))


def _pair(model_dir, root, logs):
    logs.mkdir(exist_ok=True)
    return ServedPair(model_dir, logs, extra=["--prompt-cache-disk-bytes", "50MB"],
                      rank_extra={r: ["--prompt-cache-dir", str(root / r)] for r in ("leader", "worker")})


def _complete(served, prompt, max_tokens=8) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode()
    code, answer = post_raw(served, "/v1/completions", body)
    assert code == 200, answer
    return answer


def _files(directory):
    return sorted(p for p in directory.glob("*.safetensors"))


# Five prompts, none a prefix of another: a turn each, then a second turn after the restart.
PROMPTS = [[20 + i] + list(range(30 + 7 * i, 70 + 7 * i)) for i in range(5)]
TURN = [5, 6, 7, 8]


def test_a_restart_serves_the_stored_prefixes_from_disk_and_skips_bad_files(model_dir, tmp_path):
    root = tmp_path / "cache"
    served = _pair(model_dir, root, tmp_path / "run1")
    try:
        served.wait_healthy()
        for p in PROMPTS:
            assert _complete(served, p)["choices"][0]["text"] == reference(model_dir, p, 8)
        served.stop()
    finally:
        served.close()
    leader_files, worker_files = _files(root / "leader"), _files(root / "worker")
    # Every stored prefix written through, by each rank: its own half, under its own names.
    assert len(leader_files) == len(worker_files) == 5, (leader_files, worker_files)
    assert not {p.name for p in leader_files} & {p.name for p in worker_files}
    by_prompt = _files_by_prompt(root / "leader")
    # Damage the leader's files of prompts 1-3 and remove the worker's half of prompt 4.
    cut = by_prompt[1]
    cut.write_bytes(cut.read_bytes()[:-100])
    by_prompt[2].write_bytes(np.random.default_rng(0).bytes(by_prompt[2].stat().st_size))
    _foreign_file(model_dir, tmp_path, PROMPTS[3], by_prompt[3])
    worker_half = _files_by_prompt(root / "worker")[4]
    worker_half.unlink()

    served = _pair(model_dir, root, tmp_path / "run2")
    try:
        served.wait_healthy()
        for i, prompt in enumerate(PROMPTS):
            longer = prompt + TURN
            answer = _complete(served, longer)
            assert answer["choices"][0]["text"] == reference(model_dir, longer, 8), (i, answer)
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            # Prompt 0 starts from its stored prefix; the others are computed from nothing.
            assert (cached > 0) == (i == 0), (i, cached)
        health = served.health()[1]
        assert health["disk_hits"] == 1 and health["disk_load_failures"] == 1, health
        assert health["prompt_cache_disk_entries"] >= 1, health
        log, worker_log = served.log("leader"), served.log("worker")
        assert log.count("prompt cache: skipping") == 3, log
        assert f"skipping {cut}" in log and f"skipping {by_prompt[2]}" in log and f"skipping {by_prompt[3]}" in log
        assert "another model" in log
        assert "no file" in worker_log and str(worker_half.parent) in worker_log, worker_log
        assert "ds4tp_prompt_cache_disk_hits 1.0" in _metrics(served)
    finally:
        served.close()


def _metrics(served):
    import urllib.request

    from serveutil import API_KEY

    req = urllib.request.Request(served.base + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()


def _files_by_prompt(directory):
    """The files of a rank by which of PROMPTS they start with."""
    from mlx_ds4tp.checkpoint.header import read_header_file

    found = {}
    for path in _files(directory):
        import base64

        meta = read_header_file(path)[0]["__metadata__"]  # ours flattened as "0.<key>"
        tokens = np.frombuffer(base64.b64decode(meta["0.tokens"]), dtype="<i4").tolist()
        found[next(i for i, p in enumerate(PROMPTS) if tokens[:len(p)] == p)] = path
    return found


def _foreign_file(model_dir, tmp_path, tokens, target):
    """Another model's cache of the same tokens, put where this model's leader file was."""
    from mlx_lm import load

    from mlx_ds4tp.lockstep.caches.disk_cache import DiskCache
    from mlx_ds4tp.lockstep.caches.disk_files import rank_key
    from mlx_ds4tp.lockstep.compute import fill_cache, make_cache

    other_dir = build_chat_model(tmp_path / "other", seed=11)
    model, _ = load(str(other_dir))
    cache = make_cache(model)
    fill_cache(model, tokens, cache)
    store = DiskCache(tmp_path / "other-cache", 10**8, rank_key("0" * 32, "even", 0))
    assert store.save(tokens, cache)
    shutil.copyfile(_files(tmp_path / "other-cache")[0], target)
    assert model_dir != other_dir


# ---------------------------------------------------------------------------------------------
# DiskCache alone: the bound, a full disk, damaged arrays, the kinds it refuses.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mlx_lm import load

    return load(str(build_chat_model(tmp_path_factory.mktemp("disk-unit"))))[0]


def _filled(model, tokens, bits=0):
    from mlx_ds4tp.lockstep.caches.quantized_cache import quantize_session_cache
    from mlx_ds4tp.lockstep.compute import fill_cache, make_cache

    cache = make_cache(model)
    if bits:
        cache = quantize_session_cache(cache, bits, 32)
    fill_cache(model, tokens, cache)
    return cache


def test_the_directory_stays_within_its_bound_least_recently_used_first(tiny, tmp_path):
    from mlx_ds4tp.lockstep.caches.disk_cache import DiskCache
    from mlx_ds4tp.lockstep.caches.disk_files import tokens_digest

    one = _disk_size(tiny, tmp_path)
    bound = int(3.5 * one)
    store = DiskCache(tmp_path / "d", bound, "k")
    prompts = [[3 + i] * 12 for i in range(12)]
    for i, tokens in enumerate(prompts):
        assert store.save(tokens, _filled(tiny, tokens))
        if i == 4:  # a use makes prompt 2 the most recently used
            assert store.load(tokens_digest(prompts[2]), 12) is not None
        on_disk = sum(p.stat().st_size for p in (tmp_path / "d").iterdir())
        assert on_disk <= bound and len(store) == min(i + 1, 3), (i, on_disk, bound)
    kept = {tuple(store.find(p + [1], True)[0].tolist()) for p in prompts if store.find(p + [1], True)[0] is not None}
    assert kept == {tuple(p) for p in prompts[-3:]}
    # A new store over the directory finds the same files, in the same order of use.
    again = DiskCache(tmp_path / "d", bound, "k")
    assert len(again) == 3 and again.nbytes() == store.nbytes()


def _disk_size(model, tmp_path) -> int:
    from mlx_ds4tp.lockstep.caches.disk_cache import DiskCache

    probe = DiskCache(tmp_path / "probe", 10**9, "k")
    assert probe.save([3] * 12, _filled(model, [3] * 12))
    return probe.nbytes()


def test_a_full_disk_is_logged_once_and_the_cache_stays_in_memory(tiny, tmp_path, monkeypatch, capfd):
    from mlx_ds4tp.lockstep.caches import disk_cache
    from mlx_ds4tp.lockstep.caches.disk_cache import DiskCache

    def full(snap, path):
        open(path, "wb").write(b"x" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_cache, "write_snapshot", full)
    store = DiskCache(tmp_path / "d", 10**8, "k")
    assert not store.save([4] * 10, _filled(tiny, [4] * 10))
    assert not store.save([5] * 10, _filled(tiny, [5] * 10))
    assert os.listdir(tmp_path / "d") == [] and len(store) == 0
    err = capfd.readouterr().err
    assert err.count("the disk is full") == 1 and "serving goes on from memory" in err, err
    assert store.stats["disk_write_failures"] == 2


@pytest.mark.parametrize("bits", [0, 4])
def test_a_stored_cache_loads_back_exactly_and_damaged_arrays_are_refused(tiny, tmp_path, bits, capfd):
    import mlx.core as mx

    from mlx_ds4tp.lockstep.caches.disk_cache import DiskCache
    from mlx_ds4tp.lockstep.caches.disk_files import tokens_digest
    from mlx_ds4tp.lockstep.caches.quantized_cache import SessionQuantizedKVCache

    tokens = list(range(5, 25))
    cache = _filled(tiny, tokens, bits)
    store = DiskCache(tmp_path / "d", 10**8, "k")
    assert store.save(tokens, cache)
    back = store.load(tokens_digest(tokens), len(tokens))
    assert back is not None and [type(c) for c in back] == [type(c) for c in cache]
    assert not bits or type(back[0]) is SessionQuantizedKVCache
    step = mx.array([[7]])
    assert mx.array_equal(tiny(step, cache=cache), tiny(step, cache=back))
    # One flipped byte in the arrays: the CRC refuses the file (removed, never used).
    path = _files(tmp_path / "d")[0]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.load(tokens_digest(tokens), len(tokens)) is None
    assert "CRC" in capfd.readouterr().err and not path.exists()


def test_cache_kinds_mlx_lm_cannot_rebuild_are_refused():
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from mlx_ds4tp.lockstep.caches.cache_file import cache_blocker

    class OwnCache(KVCache):
        pass

    assert cache_blocker([KVCache(), RotatingKVCache(max_size=8)]) is None
    assert "OwnCache" in cache_blocker([KVCache(), OwnCache()])


# ---------------------------------------------------------------------------------------------
# The other cache kinds, served: a quantized KV cache, a rotating window, recurrent state.
# ---------------------------------------------------------------------------------------------


def _family(tmp_path_factory, name):
    import family_configs_a
    import tiny_models
    from mlx_ds4tp.synthetic.tiny_model import save_random_model

    config, quantization = {**tiny_models.MOE_FAMILIES, **family_configs_a.CONFIGS}[name]
    return save_random_model(tmp_path_factory.mktemp(name) / name, config, quantization=quantization)


# kind -> (model, flags of every start, tokens answered before the restart). gpt_oss's sliding
# layers keep RotatingKVCache windows of 8 tokens, qwen3_5's gated delta-net layers ArraysCache
# state: neither can drop a token once the prompt is past them, so a stored cache is reused only
# for a prompt that extends all of it, and the first answer is one token (the cache then holds
# exactly the prompt). The quantized cache trims: its first answer is longer than the new turn
# keeps, so the load from disk is trimmed back to the prompt.
KINDS = {"kv8": ("llama", ["--kv-bits", "8", "--kv-group-size", "32"], 8),
         "rotating": ("gpt_oss", [], 1),
         "recurrent": ("qwen3_5", [], 1)}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_cache_kind_is_served_from_disk_after_a_restart_as_a_cold_server_answers(
        kind, model_dir, tmp_path_factory, tmp_path):
    family, flags, first = KINDS[kind]
    model = model_dir if family == "llama" else _family(tmp_path_factory, family)
    root, prompt = tmp_path / "cache", PROMPTS[0]
    longer = prompt + TURN

    def pair(run, with_dirs=True):
        (tmp_path / run).mkdir()
        if not with_dirs:
            return ServedPair(model, tmp_path / run, extra=flags)
        return ServedPair(model, tmp_path / run, extra=["--prompt-cache-disk-bytes", "50MB", *flags],
                          rank_extra={r: ["--prompt-cache-dir", str(root / r)] for r in ("leader", "worker")})

    answers = {}
    for run in ("first", "restart", "cold"):
        served = pair(run, with_dirs=run != "cold")
        try:
            served.wait_healthy()
            if run == "first":
                # The same prompt again reuses the stored cache in memory where it trims (all but
                # the prompt's last token kept), and is computed anew where it cannot.
                again = [_complete(served, prompt, first) for _ in range(2)]
                assert again[0]["choices"][0]["text"] == again[1]["choices"][0]["text"], again
                cached = again[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached == (len(prompt) - 1 if kind == "kv8" else 0), cached
            else:
                answers[run] = _complete(served, longer)
            if run == "restart":
                health = served.health()[1]
                assert health["disk_hits"] == 1 and health["disk_load_failures"] == 0, health
                cached = answers[run]["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached == len(prompt), answers[run]
                assert "ds4tp_prompt_cache_disk_hits 1.0" in _metrics(served)
            served.stop()
        finally:
            served.close()
        if run == "first":
            assert len(_files(root / "leader")) == len(_files(root / "worker")) == 1
    assert answers["restart"]["choices"][0]["text"] == answers["cold"]["choices"][0]["text"], answers


def test_the_soak_reads_memory_as_minute_medians_and_counts_files_being_written(tmp_path):
    from mlx_ds4tp.bench.disk_cache import _dir_bytes, _minute_medians

    # 150 s: minutes 0-60 s and the run's last 60 s; a spike is no median.
    samples = [(t / 2, 100 + (1000 if t == 10 else 0) + (t >= 180)) for t in range(300)]
    assert _minute_medians(samples, 150.0) == [100, 101]
    assert _minute_medians(samples, 30.0) == []
    (tmp_path / "a.safetensors").write_bytes(b"x" * 7)
    (tmp_path / ".a.1.tmp.safetensors").write_bytes(b"x" * 5)
    (tmp_path / "other").write_bytes(b"x" * 3)
    assert _dir_bytes(tmp_path) == 12 and _dir_bytes(tmp_path / "gone") == 0
