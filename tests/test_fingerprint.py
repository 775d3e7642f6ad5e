"""The model fingerprint (_fingerprint.py) and its check at the hello: a
worker holding another model is refused on both ranks before any weight is
loaded, and both name both fingerprints and the first difference."""

from __future__ import annotations

import dataclasses
import json
import shutil
import textwrap
import zlib

import mlx.core as mx
import pytest

import mlx_ds4tp as tp
from mlx_ds4tp import transport as tr
from mlx_ds4tp.errors import FrameError, HelloMismatchError
from mlx_ds4tp.link.fingerprint import (
    SAMPLE_BYTES,
    SAMPLE_WINDOWS,
    Fingerprint,
    TensorPrint,
    first_difference,
    model_fingerprint,
    summary_label,
)
from mlx_ds4tp.synthetic.tiny_model import save_random_model
from pairutil import both_ok, free_port, run_both
from tiny_models import FAMILIES

LLAMA, _ = FAMILIES["llama"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The base model and one variant per kind of difference (all tiny llamas)."""
    root = tmp_path_factory.mktemp("fingerprint")
    base = save_random_model(root / "base", LLAMA, seed=0)
    out = {"base": base}
    out["copy"] = shutil.copytree(base, root / "copy")
    out["other-weights"] = save_random_model(root / "other-weights", LLAMA, seed=1)
    out["bfloat16"] = save_random_model(root / "bfloat16", LLAMA, seed=0, dtype=mx.bfloat16)
    out["q-gs32"] = save_random_model(root / "q-gs32", LLAMA, seed=0, quantization={"group_size": 32, "bits": 4})
    out["q-gs64"] = save_random_model(root / "q-gs64", LLAMA, seed=0, quantization={"group_size": 64, "bits": 4})
    other = shutil.copytree(base, root / "other-config")
    config = json.loads((other / "config.json").read_text())
    config["rope_theta"] = 500000.0
    (other / "config.json").write_text(json.dumps(config))
    out["other-config"] = other
    # The same weights in two shards.
    sharded = root / "sharded"
    sharded.mkdir()
    shutil.copy(base / "config.json", sharded / "config.json")
    weights = mx.load(str(base / "model.safetensors"))
    names = sorted(weights)
    mx.save_safetensors(str(sharded / "model-00001-of-00002.safetensors"), {n: weights[n] for n in names[::2]})
    mx.save_safetensors(str(sharded / "model-00002-of-00002.safetensors"), {n: weights[n] for n in names[1::2]})
    out["sharded"] = sharded
    return out


DIFFERENCES = [
    ("other-weights", "base", "same shapes, different weights (first differing tensor: "),
    ("bfloat16", "base", "is BF16 here and F32 on the worker"),
    ("q-gs32", "q-gs64", "config key quantization.group_size is 32 here and 64 on the worker"),
    ("other-config", "base", "config key rope_theta is 500000.0 here and 10000.0 on the worker"),
]


# ============================================================================
# The fingerprint itself
# ============================================================================


@pytest.mark.parametrize("same", ["copy", "sharded"])
def test_the_same_model_elsewhere_or_resharded_matches(models, same):
    a, b = model_fingerprint(models["base"]), model_fingerprint(models[same])
    assert a == b and a.summary() == b.summary() and first_difference(a, b, "worker") is None


@pytest.mark.parametrize("mine, theirs, says", DIFFERENCES)
def test_each_difference_is_named(models, mine, theirs, says):
    a, b = model_fingerprint(models[mine]), model_fingerprint(models[theirs])
    assert a.digest != b.digest and a.label != b.label
    assert says in first_difference(a, b, "worker")


def test_it_reads_headers_and_small_samples_only(models):
    fp = model_fingerprint(models["base"])
    file_bytes = (models["base"] / "model.safetensors").stat().st_size
    assert len(fp.tensors) > 10
    assert fp.bytes_read <= 64 * 1024 + len(fp.tensors) * SAMPLE_WINDOWS * SAMPLE_BYTES
    assert fp.bytes_read < file_bytes / 4, (fp.bytes_read, file_bytes)


def test_details_round_trip_and_bad_details_are_frame_errors(models):
    fp = model_fingerprint(models["q-gs32"])
    back = Fingerprint.from_details(fp.details())
    assert back == fp and back.summary() == fp.summary()
    for bad in (b"not zlib", zlib.compress(b"[1, 2]"), zlib.compress(b'{"v": 99}'),
                zlib.compress(b'{"v": 1, "config": [], "tensors": [["x", "F32"]]}'),
                zlib.compress(b" " * (200 * 1024 * 1024))):
        with pytest.raises(FrameError):
            Fingerprint.from_details(bad)


def test_damaged_model_files_are_clear_errors(tmp_path, models):
    with pytest.raises(ValueError, match="config.json"):
        model_fingerprint(tmp_path)
    cut = shutil.copytree(models["base"], tmp_path / "cut")
    path = cut / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="past the file's end; the file is cut short"):
        model_fingerprint(cut)
    path.write_bytes((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header claims 1099511627776 bytes"):
        model_fingerprint(cut)


def test_one_header_reader_bounds_both_the_fingerprint_and_the_part_reader(tmp_path, models):
    """checkpoint/header.py is the one safetensors header reader: the fingerprint and
    the part reader refuse the same damaged headers with the same words."""
    from mlx_ds4tp.checkpoint.header import MAX_SAFETENSORS_HEADER_BYTES
    from mlx_ds4tp.checkpoint.parts import SafetensorsParts

    bad = shutil.copytree(models["base"], tmp_path / "bad")
    path = bad / "model.safetensors"
    for raw, message in [
        ((MAX_SAFETENSORS_HEADER_BYTES + 1).to_bytes(8, "little") + b"{}", "header claims"),
        ((2).to_bytes(8, "little") + b"[]", "not an object"),
        ((2).to_bytes(8, "little") + b"{]", "not JSON"),
        ((500).to_bytes(8, "little") + b"{}", "the file is cut short"),
        (b"\x01\x02", "shorter than a safetensors header"),
    ]:
        path.write_bytes(raw)
        for read in (model_fingerprint, lambda p: SafetensorsParts(p, 0, 2)):
            with pytest.raises(ValueError, match=message):
                read(bad)


# ============================================================================
# In the hello
# ============================================================================


def hello(fingerprint: bytes = b"") -> tr.Hello:
    return tr.Hello(role=0, transport="auto", rdma_ok=False, rdma_reason="why", session_id=7,
                    identity=tr.ModelIdentity(layers=2), fingerprint=fingerprint)


def test_hello_carries_the_summary(models):
    fp = model_fingerprint(models["base"])
    for h in (hello(), hello(fp.summary())):
        back = tr.Hello.unpack(h.pack())
        assert back.fingerprint == h.fingerprint and back.rdma_reason == "why"
    assert summary_label(fp.summary()) == fp.label and summary_label(b"") == "none"
    bad = hello(fp.summary()[:-1]).pack()
    with pytest.raises(FrameError, match="fingerprint of 51 bytes"):
        tr.Hello.unpack(bad)


def connect_both(leader_fp, worker_fp, timeout=10.0):
    port = free_port()
    lc = tr.LinkSettings.of("leader", listen=("127.0.0.1", port), timeout=timeout,
                       identity=tr.ModelIdentity(layers=2, fingerprint=leader_fp))
    wc = tr.LinkSettings.of("worker", coordinator=("127.0.0.1", port), timeout=timeout,
                       identity=tr.ModelIdentity(layers=2, fingerprint=worker_fp))
    return run_both(lambda: tr.connect(lc), lambda: tr.connect(wc), timeout=30)


def test_one_rank_without_a_fingerprint_is_refused_on_both(models):
    fp = model_fingerprint(models["base"])
    (_, le), (_, we) = connect_both(fp, None)
    for exc, peer in ((le, "worker"), (we, "leader")):
        assert isinstance(exc, HelloMismatchError), exc
        assert fp.label in str(exc) and "none" in str(exc) and peer in str(exc)


def test_pair_agrees_on_a_fingerprint_after_the_hello(models):
    """For a group made without one (load_split on a plain init): both ranks
    swap fingerprints on the control channel; equal passes, different stops both."""
    a, b = model_fingerprint(models["base"]), model_fingerprint(models["other-weights"])
    (lp, le), (wp, we) = connect_both(None, None)
    assert le is None and we is None
    try:
        both_ok(lambda: lp.agree_fingerprint(a), lambda: wp.agree_fingerprint(model_fingerprint(models["copy"])))
        (_, le), (_, we) = run_both(lambda: lp.agree_fingerprint(a), lambda: wp.agree_fingerprint(b))
        for exc in (le, we):
            assert isinstance(exc, HelloMismatchError) and "same shapes, different weights" in str(exc)
            assert a.label in str(exc) and b.label in str(exc)
    finally:
        lp.close()
        wp.close()


def test_a_big_models_details_name_the_one_differing_tensor():
    """60,000 tensors (an MoE checkpoint): details of most of a megabyte swapped
    each way, and the one tensor whose sampled bytes differ is named."""
    tensors = tuple(TensorPrint(f"model.layers.{i // 2000}.experts.{i % 2000}.weight", "U32",
                                (2048, 112), 917504, f"{i * 2654435761 % 2**64:016x}")
                    for i in range(60_000))
    a = Fingerprint(config=(("model_type", '"deepseek_v3"'),), tensors=tensors)
    changed = list(tensors)
    changed[23_456] = dataclasses.replace(changed[23_456], sample="0" * 16)
    b = Fingerprint(config=a.config, tensors=tuple(changed))
    assert len(a.details()) > 500_000
    (_, le), (_, we) = connect_both(a, b, timeout=30.0)
    for exc in (le, we):
        assert isinstance(exc, HelloMismatchError), exc
        assert "same shapes, different weights (first differing tensor: model.layers.11.experts.1456.weight)" \
            in str(exc)


RANK = textwrap.dedent(
    """
    import sys, mlx_ds4tp as tp
    from mlx_ds4tp.link.fingerprint import model_fingerprint
    role, port, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    identity = tp.ModelIdentity(layers=2, fingerprint=model_fingerprint(model))
    where = {"listen": ("127.0.0.1", port)} if role == "leader" else {"coordinator": ("127.0.0.1", port)}
    try:
        g = tp.init(role=role, transport="tcp", timeout=20.0, identity=identity, **where)
    except tp.TransportError as exc:
        print(f"ds4-tp: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    print("CONNECTED", flush=True)
    from mlx_lm.utils import load
    load(model)
    print("LOADED", flush=True)
    g.close()
    """
)


@pytest.mark.parametrize("leader_model, worker_model, says", DIFFERENCES + [("base", "copy", None)],
                         ids=[d[0] for d in DIFFERENCES] + ["same-model-copied"])
def test_two_processes_refuse_at_the_hello_before_loading(procs, models, leader_model, worker_model, says):
    port = free_port()
    leader = procs.spawn(["-c", RANK, "leader", str(port), str(models[leader_model])])
    worker = procs.spawn(["-c", RANK, "worker", str(port), str(models[worker_model])])
    (lout, lerr), (wout, werr) = leader.communicate(timeout=120), worker.communicate(timeout=120)
    if says is None:
        assert leader.returncode == worker.returncode == 0, (lerr, werr)
        assert "LOADED" in lout and "LOADED" in wout
        return
    lfp, wfp = model_fingerprint(models[leader_model]), model_fingerprint(models[worker_model])
    labels = [lfp.label, wfp.label]
    for proc, out, err in ((leader, lout, lerr), (worker, wout, werr)):
        assert proc.returncode == 1 and "CONNECTED" not in out and "LOADED" not in out, (out, err)
        assert "ds4-tp: error: model mismatch" in err and "Traceback" not in err, err
        assert all(label in err for label in labels), (labels, err)
    # Each rank names the difference from its own side.
    assert says in lerr, lerr
    assert first_difference(wfp, lfp, "leader") in werr, werr


def plain_pair(identity=None):
    port = free_port()
    kw = dict(transport="tcp", timeout=20.0, identity=identity)
    return both_ok(lambda: tp.init(role="leader", listen=("127.0.0.1", port), **kw),
                   lambda: tp.init(role="worker", coordinator=("127.0.0.1", port), **kw))


def test_load_split_compares_models_when_the_hello_did_not(models, monkeypatch):
    """init without a fingerprint: load_split swaps them first (both ranks) and
    stops both before loading; a hello that agreed on one is not asked again."""
    import mlx_lm.utils

    from mlx_ds4tp import model_split

    calls, loads = [], []
    agree, load_model = tr.Pair.agree_fingerprint, mlx_lm.utils.load_model

    def counted_agree(self, fp):
        calls.append(fp.label)
        return agree(self, fp)

    def counted_load(*args, **kw):  # load_split imports mlx-lm's loader when called
        loads.append(args[0])
        return load_model(*args, **kw)

    monkeypatch.setattr(tr.Pair, "agree_fingerprint", counted_agree)
    monkeypatch.setattr(mlx_lm.utils, "load_model", counted_load)

    base, other = model_fingerprint(models["base"]), model_fingerprint(models["other-weights"])
    leader, worker = plain_pair()
    with leader, worker:
        (_, le), (_, we) = run_both(lambda: model_split.load_split(models["base"], leader),
                                    lambda: model_split.load_split(models["other-weights"], worker))
    for exc in (le, we):
        assert isinstance(exc, HelloMismatchError), exc
        assert base.label in str(exc) and other.label in str(exc) and "different weights" in str(exc)
    assert loads == [] and sorted(calls) == sorted([base.label, other.label])

    calls.clear()
    leader, worker = plain_pair()
    with leader, worker:
        both_ok(lambda: model_split.load_split(models["base"], leader),
                lambda: model_split.load_split(models["copy"], worker))
    assert calls == [base.label, base.label] and len(loads) == 2

    calls.clear()
    identity = tp.ModelIdentity(layers=2, fingerprint=base)
    leader, worker = plain_pair(identity)
    with leader, worker:
        both_ok(lambda: model_split.load_split(models["base"], leader),
                lambda: model_split.load_split(models["copy"], worker))
    assert calls == [] and len(loads) == 4
