"""What every lockstep command is: a frame type, the bound of its payload, a payload layout,
its packing on the leader, its unpacking on both ranks (every count checked against the
payload's size before anything is read) and its application to a rank's SessionTable. Each
command is one class, written once (lockstep.protocol.commands' modules); `command` registers
it (its bound with the transport, link/wire.py), the table applies a frame by looking its type
up in COMMANDS, and the leader sends any command alike (LeaderSessions.send, .ask).
"""

from __future__ import annotations

import struct
from typing import Any, Dict, Type

import numpy as np

from ....errors import FrameError
from ....link.wire import FrameType, register_frame_bound

F = FrameType


class Command:
    """One lockstep command: its frame type (a number in link/wire.py's FrameType), `bound`
    (the most bytes its payload may have: the transport refuses a larger frame before reading
    it), `pack(*fields) -> payload` and `unpack(payload, vocab=0) -> fields` (each command has
    its own layout, so there are no defaults; `command` refuses a class without them).
    `answers`: a query, which the worker answers with a frame of the same type (HASH,
    DISK_LOAD, KV_ROOM), the reply `answer`'s; the leader asks it with LeaderSessions.ask."""

    frame: F
    bound: int
    answers = False

    @classmethod
    def apply(cls, table, *fields) -> Any:
        """Change `table` (lockstep.protocol.table.SessionTable) as the command says; the logits of a
        step command, else None."""
        raise FrameError(f"a worker rank cannot execute a {cls.frame.name} frame here")

    @classmethod
    def answer(cls, table, *fields) -> bytes:
        """The worker's reply to a query (answers=True)."""
        raise FrameError(f"a {cls.frame.name} frame has no answer")

    @classmethod
    def check(cls, reply: bytes, *fields) -> None:
        """What the worker checks once its reply went out (nothing, unless a query says)."""


class Fixed(Command):
    """A command whose payload is one fixed layout."""

    layout: struct.Struct

    @classmethod
    def pack(cls, *fields) -> bytes:
        return cls.layout.pack(*fields)

    @classmethod
    def unpack(cls, payload: bytes, vocab: int = 0) -> tuple:
        """The payload's fields; FrameError naming the frame when its size is not the layout's."""
        if len(payload) != cls.layout.size:
            raise FrameError(f"{cls.frame.name} payload is {len(payload)} bytes, expected {cls.layout.size}")
        return cls.layout.unpack(payload)


COMMANDS: Dict[F, Type[Command]] = {}


def command(cls: Type[Command]) -> Type[Command]:
    """Register a command class by its frame type, and its bound with the transport (a class
    decorator)."""
    for need in ("pack", "unpack"):
        if not callable(getattr(cls, need, None)):
            raise ImportError(f"lockstep command {cls.__name__} ({cls.frame.name}) has no {need}: give it its "
                              "payload's layout (a Fixed layout, or its own pack and unpack)")
    if not isinstance(getattr(cls, "bound", None), int):
        raise ImportError(f"lockstep command {cls.__name__} ({cls.frame.name}) has no bound: give it the most "
                          "bytes its payload may have")
    if isinstance(getattr(cls, "layout", None), struct.Struct) and cls.layout.size > cls.bound:
        raise ImportError(f"{cls.frame.name}'s {cls.layout.size}-byte layout outgrew its bound of {cls.bound}")
    if cls.frame in COMMANDS:
        raise ImportError(f"two lockstep commands for {cls.frame.name}: {COMMANDS[cls.frame].__name__}, {cls.__name__}")
    register_frame_bound(cls.frame, cls.bound)
    COMMANDS[cls.frame] = cls
    return cls


def check_tokens(tokens: np.ndarray, vocab: int) -> None:
    """FrameError unless every id is in [0, vocab) (vocab 0: unknown, not checked). Token ids
    index the embedding, which MLX does not bounds-check (an id past the table reads other
    memory or crashes), so every id from the wire is checked before the model sees it."""
    if vocab and len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab):
        bad = int(tokens[(tokens < 0) | (tokens >= vocab)][0])
        raise FrameError(f"token id {bad}, outside the model's vocabulary [0, {vocab}): "
                            "the leader runs another model or the frame is corrupt")


def shorter_than_header(frame: F, payload: bytes, header: struct.Struct) -> None:
    """FrameError when a payload cannot hold its header."""
    if len(payload) < header.size:
        raise FrameError(f"{frame.name} payload of {len(payload)} bytes is shorter than its "
                            f"{header.size}-byte header")
