"""The leader's memo of the parts it sends (split/part_memo.py) and the part's digest
(checkpoint/parts_cache.py): a second transfer of the same part is neither traced nor hashed
again and is offered every file's digest; a model file touched since is planned, traced and
hashed again; a digest the bytes do not match (the memo's, bytes changed under the same stats)
is refused, never loaded; a cache written with another digest (SHA-256's bare hex, before) is
never trusted: its files are fetched again."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from mlx_ds4tp.checkpoint.parts_cache import DIGEST_NAME, MANIFEST, PartsSettings, file_digest
from mlx_ds4tp.errors import FrameError
from mlx_ds4tp.split import part_memo, part_plan, part_send
from mlx_ds4tp.split.share import SplitShare
from test_part_send import assert_loads_as_load_split, transfer


@pytest.fixture()
def model(tmp_path_factory):
    """A model of this test's own (its files touched by some tests), and no memo from before."""
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    part_memo.forget_parts()
    yield save_llama(tmp_path_factory.mktemp("part-memo"), "tiny", seed=12)
    part_memo.forget_parts()


def count_traces(monkeypatch) -> list:
    traces = []
    real = part_plan.traced_layout  # traced with the plan: split/part_plan.py

    def traced_layout(*args, **kwargs):
        traces.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(part_plan, "traced_layout", traced_layout)
    return traces


def manifest(entry) -> dict:
    return json.loads((entry / MANIFEST).read_text())["files"]


def test_a_second_transfer_is_not_traced_or_hashed_again_and_is_offered_the_digests(model, tmp_path, monkeypatch):
    traces = count_traces(monkeypatch)
    first, sent = transfer(model, PartsSettings(tmp_path / "first"))
    assert sent["bytes"] > 0 and len(traces) == 1
    digests = manifest(first)
    assert all(d["digest"].startswith(DIGEST_NAME + ":") for d in digests.values())
    assert all(file_digest(first / name).hexdigest() == d["digest"] for name, d in digests.items())

    def no_hash(*_):
        raise AssertionError("a part file whose digest the memo holds is hashed again")

    monkeypatch.setattr(part_send, "new_digest", no_hash)
    memo = part_memo.part_memo(model, 1, 2, SplitShare.of("even"))
    offer = part_send.PartSender(model, 1, 2, SplitShare.of("even"), "f" * 32).offer()
    offered = {name: digest for name, _, digest in offer["files"]}
    assert {f.name for f in memo.plan.files} <= set(offered)
    assert all(offered[name] == d["digest"] for name, d in digests.items())

    second, sent = transfer(model, PartsSettings(tmp_path / "second"))
    assert not isinstance(second, Exception), second
    assert sent["bytes"] > 0 and len(traces) == 1
    assert manifest(second) == digests
    assert_loads_as_load_split(model, second)


def test_a_model_file_touched_since_is_traced_and_hashed_again(model, tmp_path, monkeypatch):
    traces = count_traces(monkeypatch)
    transfer(model, PartsSettings(tmp_path / "first"))
    weights = next(model.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    entry, sent = transfer(model, PartsSettings(tmp_path / "second"))
    assert not isinstance(entry, Exception), entry
    assert len(traces) == 2 and sent["bytes"] > 0


def test_a_digest_the_bytes_do_not_match_is_refused_and_never_loaded(model, tmp_path):
    transfer(model, PartsSettings(tmp_path / "first"))
    memo = part_memo.part_memo(model, 1, 2, SplitShare.of("even"))
    name = memo.plan.files[0].name
    # What a memo would hold had the model's bytes changed under the same size, mtime and inode.
    memo.digests[name] = f"{DIGEST_NAME}:{'0' * 64}"
    result, _ = transfer(model, PartsSettings(tmp_path / "second"))
    assert isinstance(result, FrameError) and "still arrive damaged" in str(result), result
    assert not list((tmp_path / "second").rglob(name))


def test_a_cache_of_another_digest_is_fetched_again(model, tmp_path):
    parts = PartsSettings(tmp_path / "parts")
    entry, _ = transfer(model, parts)
    files = manifest(entry)
    # The manifest as the SHA-256 parts cache wrote it: each file's bare hex digest, all correct.
    old = {name: {"size": d["size"], "digest": hashlib.sha256((entry / name).read_bytes()).hexdigest()}
           for name, d in files.items()}
    (entry / MANIFEST).write_text(json.dumps({"files": old}))
    part_memo.forget_parts()  # a leader started again: no digest offered before the bytes
    again, sent = transfer(model, parts)
    assert again == entry and sent["bytes"] >= sum(d["size"] for d in files.values())
    assert manifest(entry) == files
    assert_loads_as_load_split(model, entry)


def test_a_model_directory_copied_elsewhere_is_a_memo_of_its_own(model, tmp_path):
    share = SplitShare.of("even")
    first = part_memo.part_memo(model, 1, 2, share)
    assert part_memo.part_memo(model, 1, 2, share) is first
    assert part_memo.part_memo(model, 1, 2, SplitShare.of("3:1")) is not first
    copy = shutil.copytree(model, tmp_path / "copy")
    assert part_memo.part_memo(copy, 1, 2, share) is not first
