"""The leader's memo on its disk (split/part_memo_file.py): a leader started again neither plans,
traces nor hashes a part it sent before, and offers the digests; a memo file that is malformed,
of another key, made by other code, or of model files changed since (a byte flipped in place, its mtime put back) is
ignored, logged, and the part planned, traced and hashed again."""

from __future__ import annotations

import json
import os

import pytest

from mlx_ds4tp.checkpoint.parts_cache import PartsSettings
from mlx_ds4tp.split import part_memo, part_memo_file, part_send
from mlx_ds4tp.split.share import SplitShare
from test_part_memo import count_traces, manifest
from test_part_send import assert_loads_as_load_split, transfer

EVEN = SplitShare.of("even")


@pytest.fixture()
def model(tmp_path_factory, monkeypatch):
    """A model of this test's own, its leader memo files in a directory of this test's own."""
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    monkeypatch.setenv(part_memo_file.MEMO_DIR_ENV, str(tmp_path_factory.mktemp("leader-memo")))
    part_memo.forget_parts()
    yield save_llama(tmp_path_factory.mktemp("part-memo-file"), "tiny", seed=13)
    part_memo.forget_parts()


def count_plans(monkeypatch) -> list:
    plans = []
    real = part_memo.plan_part
    monkeypatch.setattr(part_memo, "plan_part", lambda *a: plans.append(a) or real(*a))
    return plans


def memo_files() -> list:
    return sorted(part_memo_file.memo_dir().glob("*.json"))


def test_a_leader_started_again_neither_plans_traces_nor_hashes(model, tmp_path, monkeypatch):
    traces, plans = count_traces(monkeypatch), count_plans(monkeypatch)
    first, _ = transfer(model, PartsSettings(tmp_path / "first"))
    assert len(traces) == 1 and len(plans) == 1 and len(memo_files()) == 1
    digests = manifest(first)

    part_memo.forget_parts()  # the leader started again: its memory is gone, its disk is not

    def no_hash(*_):
        raise AssertionError("a part file whose digest the memo file holds is hashed again")

    monkeypatch.setattr(part_send, "new_digest", no_hash)
    offer = part_send.PartSender(model, 1, 2, EVEN, "f" * 32).offer()
    offered = {name: digest for name, _, digest in offer["files"]}
    assert all(offered[name] == d["digest"] for name, d in digests.items())
    second, sent = transfer(model, PartsSettings(tmp_path / "second"))
    assert not isinstance(second, Exception), second
    assert sent["bytes"] > 0 and len(traces) == 1 and len(plans) == 1
    assert manifest(second) == digests
    assert_loads_as_load_split(model, second)


def test_a_malformed_or_foreign_memo_file_is_ignored_logged_and_rebuilt(model, tmp_path, monkeypatch, capsys):
    traces = count_traces(monkeypatch)
    transfer(model, PartsSettings(tmp_path / "first"))
    (path,) = memo_files()
    good = json.loads(path.read_text())
    for n, damaged in enumerate(("{not json", json.dumps({**good, "key": good["key"][:-1] + ["3:1"]}),
                                 json.dumps({**good, "layout": {"cut": [1, 1]}}),
                                 json.dumps({**good, "code": ["another mlx-lm"] + good["code"][1:]}))):
        path.write_text(damaged)
        part_memo.forget_parts()
        entry, sent = transfer(model, PartsSettings(tmp_path / f"again{n}"))
        assert not isinstance(entry, Exception), entry
        assert len(traces) == 2 + n and sent["bytes"] > 0
        assert "leader memo" in capsys.readouterr().err
        assert json.loads(path.read_text()) == good  # written again, whole
        assert_loads_as_load_split(model, entry)


def test_a_byte_flipped_in_a_model_file_under_the_same_mtime_is_a_new_key(model, tmp_path, monkeypatch):
    traces = count_traces(monkeypatch)
    first, _ = transfer(model, PartsSettings(tmp_path / "first"))
    weights = next(model.glob("*.safetensors"))
    stat = weights.stat()
    with open(weights, "r+b") as f:  # the last byte: the last array's data, not the header
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0x01]))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_mtime_ns == stat.st_mtime_ns and weights.stat().st_size == stat.st_size
    part_memo.forget_parts()
    second, sent = transfer(model, PartsSettings(tmp_path / "second"))
    assert not isinstance(second, Exception), second
    assert len(traces) == 2 and sent["bytes"] > 0
    assert manifest(second) != manifest(first)  # the new bytes' digest, not the memo's
    assert len(memo_files()) == 2
    assert_loads_as_load_split(model, second)


def test_an_uneven_part_read_from_the_memo_file_is_the_one_traced(model, tmp_path, monkeypatch):
    traces = count_traces(monkeypatch)
    first, _ = transfer(model, PartsSettings(tmp_path / "first"), share="3:1", rank=0)
    part_memo.forget_parts()
    memo = part_memo.part_memo(model, 0, 2, SplitShare.of("3:1"))
    assert memo.layout is not None and memo.layout.plan_group is not memo.group  # a unit's group
    second, _ = transfer(model, PartsSettings(tmp_path / "second"), share="3:1", rank=0)
    assert not isinstance(second, Exception), second
    assert len(traces) == 1 and manifest(second) == manifest(first)
    assert_loads_as_load_split(model, second, rank=0, share="3:1")
