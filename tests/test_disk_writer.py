"""The prompt cache written through (lockstep/caches/disk_writer.py, lockstep/caches/cache_file.py,
DiskCache.save_later): files written by a thread in the order handed over, waited for by a
load and by a stop; a cache seen on its own thread and changed right after is written as it
was seen; mlx-lm reads the files; a file a newer one extends is removed when caches trim."""

from __future__ import annotations

import threading

import pytest

from serveutil import build_chat_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mlx_lm import load

    return load(str(build_chat_model(tmp_path_factory.mktemp("writer-model"))))[0]


def _filled(model, tokens):
    from mlx_ds4tp.lockstep.compute import fill_cache, make_cache

    cache = make_cache(model)
    fill_cache(model, tokens, cache)
    return cache


def test_the_writer_writes_in_order_and_is_waited_for():
    from mlx_ds4tp.lockstep.caches.disk_writer import DiskWriter

    gate, written = threading.Event(), []

    def write(name, job):
        gate.wait(10)
        written.append((name, job))

    writer = DiskWriter(write, max_pending=2)
    assert writer.put("a", 1, 1.0) and writer.put("b", 2, 1.0)
    assert writer.pending("a") and writer.pending("b") and not writer.pending("c")
    assert not writer.wait_for("b", 0.2) and not writer.flush(0.2)  # held at the gate
    # Once "a" is being written and "b" waits, one more fits (max_pending counts the queue); then full.
    assert writer.put("c", 3, 10.0)
    assert not writer.put("d", 4, 0.2)
    gate.set()
    assert writer.wait_for("b", 10) and writer.flush(10)
    assert written == [("a", 1), ("b", 2), ("c", 3)]
    assert writer.close(10) == 0 and not writer.put("e", 5, 0.1)


def test_a_write_that_fails_is_logged_and_the_writer_goes_on(capfd):
    from mlx_ds4tp.lockstep.caches.disk_writer import DiskWriter

    done = []

    def write(name, job):
        if name == "bad":
            raise RuntimeError("boom")
        done.append(name)

    writer = DiskWriter(write)
    for name in ("bad", "good"):
        assert writer.put(name, None, 1.0)
    assert writer.flush(10) and done == ["good"]
    assert "writing bad failed: RuntimeError: boom" in capfd.readouterr().err
    writer.close(10)


def test_a_cache_changed_after_it_was_handed_over_is_written_as_it_was(tiny, tmp_path, monkeypatch):
    """The writer holds views of the cache's MLX buffers; the session that reuses the cache
    writes into it at once (mlx-lm's KVCache updates its arrays in place when nothing else
    holds them): the file must still hold the cache as it was handed over."""
    import mlx.core as mx

    from mlx_ds4tp.lockstep.caches import disk_cache
    from mlx_ds4tp.lockstep.caches.disk_cache import DiskCache
    from mlx_ds4tp.lockstep.caches.disk_files import tokens_digest

    gate = threading.Event()
    real = disk_cache.write_snapshot

    def held(snap, path):
        gate.wait(10)
        return real(snap, path)

    monkeypatch.setattr(disk_cache, "write_snapshot", held)
    tokens = list(range(5, 25))
    cache = _filled(tiny, tokens)
    store = DiskCache(tmp_path / "d", 10**8, "k")
    assert store.save_later(tokens, cache)
    for t in (7, 8, 9):  # the cache grows past what was handed over, in its own buffers
        mx.eval(tiny(mx.array([[t]]), cache=cache))
    gate.set()
    assert store.flush(10) and len(store) == 1
    back = store.load(tokens_digest(tokens), len(tokens))
    fresh = _filled(tiny, tokens)
    step = mx.array([[11]])
    assert back[0].offset == len(tokens)
    # Every byte of the state as handed over, the buffers' room past the offset too (where the
    # three later tokens went in the cache itself).
    for b, f in zip(back, fresh):
        assert mx.array_equal(b.keys, f.keys) and mx.array_equal(b.values, f.values)
    assert not mx.array_equal(cache[0].keys, fresh[0].keys)
    assert mx.array_equal(tiny(step, cache=back), tiny(step, cache=fresh))
    # mlx-lm's own loader reads the file as it reads its own.
    from mlx_lm.models.cache import load_prompt_cache

    loaded, meta = load_prompt_cache(str(next((tmp_path / "d").glob("*.safetensors"))), return_metadata=True)
    assert meta["count"] == str(len(tokens)) and len(loaded) == len(cache)
    store.close()


def test_a_load_waits_for_its_file_and_find_counts_files_being_written(tiny, tmp_path, monkeypatch):
    from mlx_ds4tp.lockstep.caches import disk_cache
    from mlx_ds4tp.lockstep.caches.disk_cache import DiskCache
    from mlx_ds4tp.lockstep.caches.disk_files import tokens_digest

    gate = threading.Event()
    real = disk_cache.write_snapshot
    monkeypatch.setattr(disk_cache, "write_snapshot", lambda snap, path: (gate.wait(10), real(snap, path))[1])
    tokens = list(range(30, 50))
    store = DiskCache(tmp_path / "d", 10**8, "k")
    assert store.save_later(tokens, _filled(tiny, tokens))
    found, keep = store.find(tokens + [1, 2], True)
    assert found.tolist() == tokens and keep == len(tokens)
    threading.Timer(0.3, gate.set).start()
    assert store.load(tokens_digest(tokens), len(tokens)) is not None
    store.close()


@pytest.mark.parametrize("trimmable", [True, False])
def test_a_file_a_newer_one_extends_goes_when_caches_trim(tiny, tmp_path, trimmable):
    from mlx_ds4tp.lockstep.caches.disk_cache import DiskCache

    first = list(range(60, 80))
    second = first + [3, 4, 5, 6]
    store = DiskCache(tmp_path / "d", 10**8, "k", trimmable=trimmable)
    for tokens in (first, second):
        assert store.save_later(tokens, _filled(tiny, tokens))
    assert store.flush(10)
    assert len(store) == (1 if trimmable else 2)
    assert len(list((tmp_path / "d").glob("*.safetensors"))) == len(store)
    store.close()


def test_a_write_cut_short_leaves_the_old_files_and_no_torn_one(tiny, tmp_path, monkeypatch):
    """A kill in the middle of a write: the temporary file is all it touched; the next start
    finds the files written before it, whole, and removes the temporary one."""
    from mlx_ds4tp.lockstep.caches import disk_cache
    from mlx_ds4tp.lockstep.caches.disk_cache import DiskCache
    from mlx_ds4tp.lockstep.caches.disk_files import tokens_digest

    store = DiskCache(tmp_path / "d", 10**8, "k")
    old = list(range(90, 110))
    assert store.save(old, _filled(tiny, old))

    def killed(snap, path):
        path.write_bytes(b"\0" * 100)  # part of the file, then the process is gone
        raise OSError("killed")

    monkeypatch.setattr(disk_cache, "write_snapshot", killed)
    new = list(range(120, 140))
    assert not store.save(new, _filled(tiny, new))
    monkeypatch.undo()
    names = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert len(names) == 1 and not names[0].startswith("."), names
    (tmp_path / "d" / f".{names[0]}.1-2.tmp.safetensors").write_bytes(b"\0" * 100)  # one a kill -9 left
    again = DiskCache(tmp_path / "d", 10**8, "k")
    assert len(again) == 1 and again.load(tokens_digest(old), len(old)) is not None
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == names


def test_a_writer_behind_puts_off_a_cache_that_stays_in_memory_and_waits_for_one_leaving(
        tiny, tmp_path, monkeypatch, capfd):
    from mlx_ds4tp.lockstep.caches import disk_cache
    from mlx_ds4tp.lockstep.caches.disk_cache import DiskCache

    gate, writing = threading.Event(), threading.Event()
    real = disk_cache.write_snapshot

    def held(snap, path):
        writing.set()
        gate.wait(10)
        return real(snap, path)

    monkeypatch.setattr(disk_cache, "write_snapshot", held)
    store = DiskCache(tmp_path / "d", 10**8, "k")
    store._writer.max_pending = 1
    prompts = [[40 + i] * 12 for i in range(3)]
    cache = _filled(tiny, prompts[0])
    assert store.save_later(prompts[0], cache, wait=False)
    assert writing.wait(10)  # being written, held at the gate
    assert store.save_later(prompts[1], cache, wait=False)  # queued
    assert not store.save_later(prompts[2], cache, wait=False)  # no room: put off, never waited for
    assert store.stats["disk_writes_put_off"] == 1
    assert "caches it has no room for are written when they leave memory" in capfd.readouterr().err
    threading.Timer(0.3, gate.set).start()
    assert store.save_later(prompts[2], cache, wait=True)  # leaving memory: waits for room
    assert store.flush(10) and len(store) == 3
    store.close()
