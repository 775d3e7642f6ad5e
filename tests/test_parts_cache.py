"""A worker's parts cache (checkpoint/parts_cache.py): what it keeps, what it wants again, its
bound (the least recently used entries out first, other models before this one's other shares)."""

from __future__ import annotations

import os

import pytest

from mlx_ds4tp.checkpoint.parts_cache import OfferedFile, PartEntry, PartsSettings, new_digest


def fill(entry: PartEntry, name: str, data: bytes) -> OfferedFile:
    """`name` received whole into `entry` (through its writer), and its offer."""
    entry.path.mkdir(parents=True, exist_ok=True)
    writer = entry.writer(name, 0, len(data))
    writer.write(data)
    digest = writer.hash.hexdigest()
    assert writer.finish(digest)
    return OfferedFile(name, len(data))


def test_whole_files_are_kept_damaged_partial_and_stray_ones_are_not(tmp_path):
    entry = PartEntry(PartsSettings(tmp_path), "model-a", 1, 2, "even")
    offer = [fill(entry, "a.bin", b"a" * 1000), fill(entry, "b.bin", b"b" * 1000), OfferedFile("c.bin", 500)]
    (entry.path / "c.bin.partial").write_bytes(b"c" * 200)
    (entry.path / "stray.bin").write_bytes(b"?")
    assert entry.wanted(offer) == [("c.bin", 200)]
    assert not (entry.path / "stray.bin").exists()

    with open(entry.path / "b.bin", "r+b") as f:  # one flipped byte
        f.seek(10)
        f.write(b"x")
    assert entry.wanted(offer) == [("b.bin", 0), ("c.bin", 200)]
    assert not (entry.path / "b.bin").exists()


def test_a_file_of_another_size_or_digest_than_offered_is_fetched_again(tmp_path):
    entry = PartEntry(PartsSettings(tmp_path), "model-a", 1, 2, "even")
    fill(entry, "a.bin", b"a" * 100)
    assert entry.wanted([OfferedFile("a.bin", 101)]) == [("a.bin", 0)]
    fill(entry, "t.json", b"{}")
    assert entry.wanted([OfferedFile("t.json", 2, "0" * 32)]) == [("t.json", 0)]


def test_a_resumed_file_is_checked_whole(tmp_path):
    entry = PartEntry(PartsSettings(tmp_path), "m", 1, 2, "even")
    entry.path.mkdir(parents=True)
    data = bytes(range(256)) * 4
    (entry.path / "p.bin.partial").write_bytes(data[:300])
    writer = entry.writer("p.bin", 300, len(data))
    writer.write(data[300:])
    digest = new_digest()
    digest.update(data)
    assert writer.finish(digest.hexdigest())
    assert (entry.path / "p.bin").read_bytes() == data
    # Past its offered size, or a digest that differs: refused, removed.
    writer = entry.writer("q.bin", 0, 4)
    with pytest.raises(ValueError, match="past its offered 4 bytes"):
        writer.write(b"12345")
    writer = entry.writer("q.bin", 0, 4)
    writer.write(b"1234")
    assert not writer.finish("0" * 32) and not list(entry.path.glob("q.bin*"))


def test_the_bound_removes_the_least_recently_used_other_models_first(tmp_path):
    settings = PartsSettings(tmp_path, max_bytes=3000)
    old = PartEntry(settings, "model-old", 1, 2, "even")
    fill(old, "w.bin", b"o" * 1000)
    sibling = PartEntry(settings, "model-new", 1, 2, "3-1")
    fill(sibling, "w.bin", b"s" * 1000)
    newer = PartEntry(settings, "model-newer", 1, 2, "even")
    fill(newer, "w.bin", b"n" * 1000)
    os.utime(old.path, (1, 1))
    os.utime(newer.path, (2, 2))
    os.utime(sibling.path, (0, 0))  # older still, but of the model this rank now needs
    current = PartEntry(settings, "model-new", 1, 2, "even")
    current.path.mkdir(parents=True)
    current.make_room(1500)
    assert not old.path.exists() and not newer.path.exists() and sibling.path.exists()
    assert not (tmp_path / "model-old").exists()
    with pytest.raises(ValueError, match="raise --parts-max-gb"):
        current.make_room(3500)


def test_settings_refuse_a_bound_of_nothing(tmp_path):
    with pytest.raises(ValueError, match="--parts-max-gb 0"):
        PartsSettings(tmp_path, max_bytes=0)


@pytest.mark.parametrize("name", ["../x", "a/b", "manifest.json", "x.partial", ""])
def test_an_offered_name_that_is_not_a_plain_file_name_is_refused(name):
    with pytest.raises(ValueError, match="plain names"):
        OfferedFile(name, 1).check()


def test_without_the_blake3_package_the_digest_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "blake3", None)  # an install without it: the import fails
    with pytest.raises(ImportError, match="pip install blake3"):
        new_digest()


@pytest.mark.parametrize("cores", [2, 16])
def test_a_received_files_digest_is_the_same_on_one_core_or_spread_over_many(tmp_path, monkeypatch, cores):
    """A received file's digest runs on one thread on a machine of few cores (spread_as_arriving):
    the same digest, resumed or not, as the leader's spread one and as the file read again."""
    from mlx_ds4tp.checkpoint import parts_cache

    monkeypatch.setattr(parts_cache.os, "cpu_count", lambda: cores)
    assert parts_cache.spread_as_arriving() == (cores >= parts_cache.SPREAD_MIN_CORES)
    data = os.urandom(3 << 20)
    leaders = new_digest()
    leaders.update(data)
    entry = PartEntry(PartsSettings(tmp_path), "m", 1, 2, "even")
    entry.path.mkdir(parents=True)
    (entry.path / "p.bin.partial").write_bytes(data[: 1 << 20])
    writer = entry.writer("p.bin", 1 << 20, len(data))
    for at in range(1 << 20, len(data), 1 << 18):
        writer.write(data[at: at + (1 << 18)])
    assert writer.finish(leaders.hexdigest())
    assert parts_cache.file_digest(entry.path / "p.bin", spread=False).hexdigest() == leaders.hexdigest()
