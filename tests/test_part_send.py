"""The part's transfer itself (split/part_send.py, split/part_receive.py, split/part_plan.py) in
one process, both sides over a socket pair of control channels: the received part loads into
the arrays load_split keeps on that rank; a transfer cut by a dead leader resumes where it
stopped (fewer bytes the second time); a leader's offer for another model is refused; while a
part is under way the leader's /health says to which rank, how far and how fast."""

from __future__ import annotations

import socket
import threading
import time
import types

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_ds4tp.checkpoint.parts_cache import PartsSettings
from mlx_ds4tp.collectives.backend import cut_only_group
from mlx_ds4tp.errors import FrameError, TransportError
from mlx_ds4tp.link.control import ControlChannel
from mlx_ds4tp.link.fingerprint import model_fingerprint
from mlx_ds4tp.link.wire import FrameType
from mlx_ds4tp.model_split import load_split
from mlx_ds4tp.split import part_send
from mlx_ds4tp.split.part_plan import load_part
from mlx_ds4tp.split.part_receive import receive_part, stated_fingerprint
from mlx_ds4tp.split.part_send import PartSender
from mlx_ds4tp.split.share import SplitShare


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    return save_llama(tmp_path_factory.mktemp("part-send"), "tiny", seed=11)


class CutAfter:
    """The leader's control channel, dead once `nbytes` of PART_DATA went (a killed leader)."""

    def __init__(self, control: ControlChannel, nbytes: int):
        self.control, self.left = control, nbytes

    def send(self, ftype, payload=b""):
        if ftype == FrameType.PART_DATA:
            if self.left <= 0:
                self.control.sock.close()
                raise TransportError("the leader was killed")
            self.left -= len(payload)
        self.control.send(ftype, payload)

    def recv(self, *args, **kwargs):
        return self.control.recv(*args, **kwargs)


class HeldAfter(CutAfter):
    """The leader's control channel, held once `nbytes` of PART_DATA went until `release` is set
    (`held` is set then): a transfer caught mid-way."""

    def __init__(self, control: ControlChannel, nbytes: int):
        super().__init__(control, nbytes)
        self.held, self.release = threading.Event(), threading.Event()

    def send(self, ftype, payload=b""):
        if ftype == FrameType.PART_DATA and self.left <= 0 and not self.release.is_set():
            self.held.set()
            assert self.release.wait(60)
        if ftype == FrameType.PART_DATA:
            self.left -= len(payload)
        self.control.send(ftype, payload)


def transfer(model, parts: PartsSettings, share="even", rank=1, size=2, cut_after=None, fingerprint=None,
             wrap=None):
    """One transfer of rank's part: (the receiver's entry or its exception, bytes the leader sent)."""
    a, b = socket.socketpair()
    leader, worker = ControlChannel(a, 30.0), ControlChannel(b, 30.0)
    summary = model_fingerprint(model).summary()
    sent = {}

    def lead():
        control = wrap(leader) if wrap else leader if cut_after is None else CutAfter(leader, cut_after)
        try:
            sender = PartSender(model, rank, size, SplitShare.of(share), fingerprint or stated_fingerprint(summary))
            sent["bytes"] = sender.send(control)
        except (TransportError, OSError, FrameError) as exc:
            sent["error"] = exc
        finally:
            a.close()

    thread = threading.Thread(target=lead)
    thread.start()
    link = types.SimpleNamespace(control=worker, peer_hello=types.SimpleNamespace(fingerprint=summary))
    try:
        result = receive_part(link, rank, size, SplitShare.of(share), parts)
    except (TransportError, FrameError, OSError) as exc:
        result = exc
    finally:
        b.close()  # a worker that gave up: the leader's wait ends with the connection
        thread.join(60)
    return result, sent


def assert_loads_as_load_split(model, entry, rank=1, size=2, share="even"):
    mine, _ = load_part(entry, cut_only_group(rank, size), SplitShare.of(share))
    ref, _ = load_split(str(model), cut_only_group(rank, size), split=share)
    got, want = dict(tree_flatten(mine.parameters())), dict(tree_flatten(ref.parameters()))
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].shape == want[key].shape and mx.array_equal(got[key], want[key]).item(), key


def test_received_part_is_the_arrays_load_split_keeps(model, tmp_path):
    entry, sent = transfer(model, PartsSettings(tmp_path / "parts"), share="3:1")
    assert sent["bytes"] > 0
    assert_loads_as_load_split(model, entry, share="3:1")
    again, sent = transfer(model, PartsSettings(tmp_path / "parts"), share="3:1")
    assert again == entry and sent["bytes"] == 0


def test_a_transfer_cut_by_a_dead_leader_resumes_where_it_stopped(model, tmp_path, monkeypatch):
    monkeypatch.setattr(part_send, "CHUNK_BYTES", 64 << 10)
    parts = PartsSettings(tmp_path / "parts")
    whole, _ = transfer(model, PartsSettings(tmp_path / "whole"))
    part_size = sum(f.stat().st_size for f in whole.iterdir() if f.name != "manifest.json")

    cut, sent = transfer(model, parts, cut_after=300 << 10)
    assert isinstance(cut, (TransportError, OSError)) and "error" in sent
    (partial,) = [f for f in (tmp_path / "parts").rglob("*.partial")]
    kept = partial.stat().st_size
    assert kept >= 64 << 10

    entry, sent = transfer(model, parts)
    assert 0 < sent["bytes"] <= part_size - kept
    assert not list(entry.glob("*.partial"))
    assert_loads_as_load_split(model, entry)


def test_a_damaged_partial_prefix_is_caught_by_the_digest_and_fetched_again(model, tmp_path, monkeypatch):
    monkeypatch.setattr(part_send, "CHUNK_BYTES", 64 << 10)
    parts = PartsSettings(tmp_path / "parts")
    transfer(model, parts, cut_after=200 << 10)
    (partial,) = list((tmp_path / "parts").rglob("*.partial"))
    data = bytearray(partial.read_bytes())
    data[-10] ^= 1
    partial.write_bytes(bytes(data))
    entry, sent = transfer(model, parts)
    assert not isinstance(entry, Exception), entry
    assert_loads_as_load_split(model, entry)


def test_an_offer_of_another_model_is_refused(model, tmp_path):
    result, _ = transfer(model, PartsSettings(tmp_path / "parts"), fingerprint="0" * 32)
    assert isinstance(result, FrameError) and "offered the part of model 000000000000" in str(result)
    assert not list((tmp_path / "parts").rglob("part-*"))


def test_a_part_under_way_is_on_the_leaders_health(model, tmp_path, monkeypatch):
    from mlx_ds4tp.split.transfer_progress import parts_in_flight
    from test_serve_routes import ScriptedEngine, client

    monkeypatch.setattr(part_send, "CHUNK_BYTES", 64 << 10)
    held = {}

    def wrap(control):
        held["channel"] = HeldAfter(control, 128 << 10)
        return held["channel"]

    assert parts_in_flight() == {}
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        zip(("entry", "sent"), transfer(model, PartsSettings(tmp_path / "parts"), wrap=wrap))))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while "channel" not in held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held["channel"].held.wait(60)
        health = client(ScriptedEngine()).get("/health").json()
        (under_way,) = health["parts_sending"]
        assert under_way["rank"] == 1 and 128 << 10 <= under_way["bytes"] < under_way["total_bytes"]
        assert under_way["bytes_per_s"] > 0 and under_way["seconds_left"] >= 0
    finally:
        if "channel" in held:
            held["channel"].release.set()
        thread.join(60)
    assert not isinstance(result["entry"], Exception), result["entry"]
    assert parts_in_flight() == {} and "parts_sending" not in client(ScriptedEngine()).get("/health").json()


def test_an_offer_over_rdma_to_a_worker_whose_link_is_not_rdma_is_refused_by_name(model, tmp_path):
    class NoBulk:
        chunk = part_send.CHUNK_BYTES

        def send(self, piece):
            raise AssertionError("no byte goes before the worker wants it")

    a, b = socket.socketpair()
    leader, worker = ControlChannel(a, 30.0), ControlChannel(b, 30.0)
    summary = model_fingerprint(model).summary()

    def lead():
        try:
            PartSender(model, 1, 2, SplitShare.of("even"), stated_fingerprint(summary)).send(leader, NoBulk())
        except (TransportError, OSError):
            pass
        finally:
            a.close()

    thread = threading.Thread(target=lead)
    thread.start()
    link = types.SimpleNamespace(control=worker, peer_hello=types.SimpleNamespace(fingerprint=summary))
    with pytest.raises(FrameError, match="over the RDMA bulk path, and this rank's link to it is not RDMA"):
        receive_part(link, 1, 2, SplitShare.of("even"), PartsSettings(tmp_path / "parts"))
    b.close()
    thread.join(60)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A 4-bit llama, a quantized MoE with MLA (deepseek_v3), a MoE whose experts are saved one
    by one (the original Hugging Face layout) and gpt-oss as released (gate and up fused, rows
    interleaved: its experts cut through MLX)."""
    import tiny_models
    from mlx_ds4tp.split.plans import saved_layout
    from test_model_split_moe import _save_gpt_oss_original, _save_per_expert

    root = tmp_path_factory.mktemp("part-checkpoints")
    built = {name: tiny_models.build(name, root) for name in ("llama-q4", "deepseek_v3-q4", "qwen3_moe",
                                                               "gpt_oss-mxfp4")}
    per_expert = root / "qwen3_moe-one-by-one"
    _save_per_expert(built["qwen3_moe"], per_expert, saved_layout("mlx_lm.models.qwen3_moe")["expert_keys"])
    original = root / "gpt_oss-original"
    _save_gpt_oss_original(built["gpt_oss-mxfp4"], original)
    return {"llama-q4": built["llama-q4"], "deepseek_v3-q4": built["deepseek_v3-q4"],
            "qwen3_moe-one-by-one": per_expert, "gpt_oss-original": original}


@pytest.mark.parametrize("name,share,rank,size", [
    ("llama-q4", "even", 1, 2), ("llama-q4", "3:1", 1, 2), ("deepseek_v3-q4", "even", 1, 2),
    ("qwen3_moe-one-by-one", "even", 1, 2), ("gpt_oss-original", "even", 0, 2)])
def test_the_part_sent_from_the_files_byte_runs_is_what_load_split_keeps(checkpoints, tmp_path, name, share,
                                                                         rank, size):
    from mlx_ds4tp.split import part_memo

    model = checkpoints[name]
    part_memo.forget_parts()
    entry, sent = transfer(model, PartsSettings(tmp_path / "parts"), share=share, rank=rank, size=size)
    assert not isinstance(entry, Exception), entry
    assert_loads_as_load_split(model, entry, rank=rank, size=size, share=share)
    # Every array the cut reads from the files goes from their bytes, not through MLX: only the
    # arrays every rank keeps whole (norms, MLA's low-rank projections, routers) and, in gpt-oss
    # as released, its experts (read from fused rows and mxfp4 blocks) go through MLX.
    memo = part_memo.part_memo(model, rank, size, SplitShare.of(share))
    keys = {t.key for f in memo.plan.files for t in f.tensors}
    cut = keys & set(memo.layout.plan.cuts)
    through_mlx = keys - set(memo.plan.sources)
    assert cut and through_mlx  # both kinds are in every one of these parts
    if name == "gpt_oss-original":
        assert through_mlx & cut and all(".experts." in key for key in through_mlx & cut), through_mlx & cut
    else:
        assert not through_mlx & cut, through_mlx & cut
        assert any("embed_tokens" in key for key in keys - through_mlx)  # the vocabulary's rows


def test_the_leader_sends_several_workers_their_parts_at_once(tmp_path):
    """Two workers without the model (ranks 1 and 2 of 3, over TCP): rank 2's whole part arrives
    while rank 1's transfer is held mid-way, so neither waits for the other's cable."""
    from mlx_ds4tp.split.part_delivery import send_parts
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    model = save_llama(tmp_path / "llama8", "tiny8", seed=4)
    summary = model_fingerprint(model).summary()
    share = SplitShare.of("2:1:1")
    sockets = {rank: socket.socketpair() for rank in (1, 2)}
    held = HeldAfter(ControlChannel(sockets[1][0], 30.0), 1)
    leader_side = {1: held, 2: ControlChannel(sockets[2][0], 30.0)}
    group = types.SimpleNamespace(size=lambda: 3, link_to=lambda r: types.SimpleNamespace(
        control=leader_side[r], transport="tcp"))
    results, sent = {}, {}

    def lead():
        try:
            send_parts(group, model, share, stated_fingerprint(summary), [1, 2])
            sent["done"] = True
        except Exception as exc:  # noqa: BLE001 - asserted below
            sent["error"] = exc

    def work(rank):
        link = types.SimpleNamespace(control=ControlChannel(sockets[rank][1], 30.0),
                                     peer_hello=types.SimpleNamespace(fingerprint=summary))
        try:
            results[rank] = receive_part(link, rank, 3, share, PartsSettings(tmp_path / f"parts{rank}"))
        except Exception as exc:  # noqa: BLE001 - asserted below
            results[rank] = exc

    threads = {"leader": threading.Thread(target=lead)}
    threads.update({rank: threading.Thread(target=work, args=(rank,)) for rank in (1, 2)})
    for thread in threads.values():
        thread.start()
    try:
        assert held.held.wait(60), "rank 1's transfer never started"
        threads[2].join(60)
        assert not threads[2].is_alive() and 2 in results, "rank 2 waited for rank 1's transfer"
        assert not isinstance(results[2], Exception), results[2]
        assert 1 not in results  # still held
    finally:
        held.release.set()
        for thread in threads.values():
            thread.join(60)
        for a, b in sockets.values():
            a.close()
            b.close()
    assert sent == {"done": True}, sent
    for rank in (1, 2):
        assert not isinstance(results[rank], Exception), results[rank]
        assert_loads_as_load_split(model, results[rank], rank=rank, size=3, share="2:1:1")
