"""A prefill forward of its own, as the scheduler planned it (serve/engine/schedule.py chose its
rows and chunks): one chunk of each planned prompt in one padded forward on every rank
(PREFILL_BATCH, through the leader's batch), timed for the mixed-prefill estimates
(serve/engine/mixing.py) and counted for /health."""

from __future__ import annotations

import time
from typing import List, Sequence, Tuple

from ...lockstep.batch import Batch
from .mixing import MixChoice


class PrefillForward:
    """Runs planned prefill forwards (see the module docstring)."""

    def __init__(self, mixing: MixChoice):
        self.mixing = mixing
        self.stats = {"prefilled_tokens": 0, "prefill_batches": 0, "prefill_batch_rows": 0,
                      "prefill_padded_tokens": 0}

    def run(self, batch: Batch, chunks: Sequence[Tuple[int, int]]) -> List[int]:
        """One forward over (row id, tokens) chunks; the ids whose prefill that finished."""
        total = sum(n for _, n in chunks)
        began = time.perf_counter()
        done = batch.prefill(chunks)
        self.mixing.prefill_timed(time.perf_counter() - began, total)
        self.stats["prefilled_tokens"] += total
        self.stats["prefill_batches"] += 1
        self.stats["prefill_batch_rows"] = max(self.stats["prefill_batch_rows"], len(chunks))
        self.stats["prefill_padded_tokens"] = max(self.stats["prefill_padded_tokens"],
                                                  len(chunks) * max(n for _, n in chunks))
        return done
