"""The leader's questions to the worker, answered with a frame of the same type: HASH (its
hash of the last step's logits or of a session's sampled tokens) and KV_ROOM (how many KV cache
tokens its machine holds)."""

from __future__ import annotations

import struct

from ....base.log import log
from ....errors import FrameError, LockstepDivergenceError
from .base import F, Fixed, command


def check_in_step(step: int, mine: int, peer_step: int, theirs: int, peer: str, what: str) -> None:
    """Both ranks' decode step and hash (of `what`) must agree: LockstepDivergenceError otherwise."""
    if (peer_step, theirs) != (step, mine):
        raise LockstepDivergenceError(f"LOCKSTEP DIVERGENCE at seq {step}: the {what} differ: local {mine:016x}, "
                                 f"{peer} {theirs:016x} at its seq {peer_step} (seq: the decode step)")


@command
class Hash(Fixed):
    """0: the last decode step's logits are hashed, else a session id: the tokens this rank
    sampled for it (DecodeBatch.hash_of); then the decode step and the hash. The worker
    answers with its own and stops with LockstepDivergenceError when they differ."""

    frame = F.HASH
    bound = 64
    answers = True
    layout = struct.Struct("<QQQ")  # 0 or a session, decode step, hash

    @classmethod
    def answer(cls, table, session: int, step: int, theirs: int) -> bytes:
        return cls.pack(session, table.batch.step_count, table.batch.hash_of(session)[0])

    @classmethod
    def check(cls, reply: bytes, session: int, step: int, theirs: int) -> None:
        """After the reply went out (the leader then sees both hashes): LockstepDivergenceError
        when the leader's hash is not this rank's."""
        _, my_step, mine = cls.unpack(reply)
        what = "logits" if session == 0 else "tokens decoded"
        check_in_step(my_step, mine, step, theirs, "leader", what)


@command
class KvRoom(Fixed):
    """The KV cache tokens the worker's machine holds beside its part of the weights, for the
    leader's cache kind; the answer has the same layout, `measured` set when it could tell."""

    frame = F.KV_ROOM
    bound = 64
    answers = True
    layout = struct.Struct("<HHIQ")  # KV bits (0: float), group size, 1: measured (the answer), tokens

    @classmethod
    def answer(cls, table, bits: int, group_size: int, _measured: int, _tokens: int) -> bytes:
        from ...caches.memory import default_kv_budget
        from ...caches.session_caches import KV_BITS, KV_GROUP_SIZES

        if bits and (bits not in KV_BITS or group_size not in KV_GROUP_SIZES):
            raise FrameError(f"KV_ROOM asks about a KV cache of {bits} bits in groups of {group_size} "
                                f"(bits 0 or {KV_BITS}, groups {KV_GROUP_SIZES})")
        tokens, how = default_kv_budget(table.model, bits, group_size)
        log(f"serve: on the worker, {how}")
        return cls.pack(bits, group_size, int(tokens is not None), tokens or 0)
