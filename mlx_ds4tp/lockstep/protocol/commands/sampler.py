"""SAMPLER: both ranks sample a session's rows alike from now on (lockstep.sampling.row_sampling), so an
EVAL_BATCH row may take this rank's own sample (EVAL_PENDING)."""

from __future__ import annotations

import struct
from typing import List, Sequence, Tuple

import numpy as np

from ....errors import FrameError
from ...sampling.options import SamplingOptions, options_from_json, options_to_json, processor_context
from .base import Command, F, check_tokens, command, shorter_than_header
from .limits import MAX_SAMPLER_OPTIONS_BYTES, MAX_TOKENS_PER_FRAME


@command
class Sampler(Command):
    """The session's options, random seed and the prompt's latest tokens (as many as its
    penalties look at, at least one)."""

    frame = F.SAMPLER
    bound = 64 + 4 * MAX_TOKENS_PER_FRAME + MAX_SAMPLER_OPTIONS_BYTES  # header, context, options
    header = struct.Struct("<QQII")  # session id, seed, context tokens, options bytes; then both

    @classmethod
    def pack(cls, session: int, options: SamplingOptions, prompt: Sequence[int], seed: int) -> bytes:
        keep = max(1, processor_context(options))
        context = np.asarray(list(prompt)[-keep:], dtype="<i4")
        body = options_to_json(options)
        return cls.header.pack(session, seed, len(context), len(body)) + context.tobytes() + body

    @classmethod
    def unpack(cls, payload: bytes, vocab: int = 0) -> Tuple[int, SamplingOptions, List[int], int]:
        """(session, options, context tokens, seed)."""
        shorter_than_header(cls.frame, payload, cls.header)
        session, seed, count, nbytes = cls.header.unpack_from(payload)
        if not 0 < count <= MAX_TOKENS_PER_FRAME or nbytes > MAX_SAMPLER_OPTIONS_BYTES \
                or len(payload) != cls.header.size + 4 * count + nbytes:
            raise FrameError(f"SAMPLER says {count} context tokens (1 to {MAX_TOKENS_PER_FRAME}) and "
                                f"{nbytes} option bytes (at most {MAX_SAMPLER_OPTIONS_BYTES}) in a "
                                f"{len(payload)}-byte payload")
        context = np.frombuffer(payload, dtype="<i4", count=count, offset=cls.header.size)
        check_tokens(context, vocab)
        try:
            options = options_from_json(payload[cls.header.size + 4 * count:])
        except ValueError as exc:
            raise FrameError(f"SAMPLER: {exc}") from None
        return session, options, context.tolist(), seed

    @classmethod
    def apply(cls, table, session: int, options: SamplingOptions, context: List[int], seed: int) -> None:
        table.set_sampler(session, options, context, seed)
