"""What the requests of `ds4tp serve` share: the engine, the server's fixed answers, its
metrics, and the conversations kept for the Responses API's previous_response_id."""

from __future__ import annotations

import collections
import threading
import time
from typing import List

from .engine.loop import Engine
from .errors import ApiError
from .http.metrics import ServeMetrics
from .settings import HttpSettings, ServedModel

KEPT_RESPONSES = 64  # conversations kept for previous_response_id


class ResponseStore:
    """The conversations of the last responses, by response id (for previous_response_id)."""

    def __init__(self, size: int = KEPT_RESPONSES):
        self.size = size
        self._kept: "collections.OrderedDict[str, List[dict]]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, response_id: str) -> List[dict]:
        with self._lock:
            if response_id not in self._kept:
                raise ApiError(404, f"previous_response_id '{response_id}' is not known here (this server "
                               f"keeps its last {self.size} responses, in memory)", "previous_response_id",
                               "not_found")
            self._kept.move_to_end(response_id)
            return list(self._kept[response_id])

    def put(self, response_id: str, messages: List[dict]) -> None:
        with self._lock:
            self._kept[response_id] = messages
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)


class ServeState:
    """What every request reads: set once the pair is up (serve/serving_rank.py), shared by the requests."""

    def __init__(self, engine: Engine, tokenizer, served: ServedModel, http: HttpSettings,
                 context_length: int, vocab_size: int):
        if not http.keepalive_sec > 0:
            raise ValueError(f"--keepalive-sec {http.keepalive_sec}: give a positive number of seconds")
        self.engine, self.tokenizer, self.http = engine, tokenizer, http
        # The first id is the one /v1/models lists (--served-model-name); a request may also name
        # an alias (the model as --model gave it, its directory), answered under its own name.
        self.model_ids = list(served.ids)
        self.context_length, self.vocab_size = context_length, vocab_size
        self.responses = ResponseStore()
        # Constrained requests' grammars, compiled and cached once for both the check and the rows.
        self.grammars = getattr(engine.sessions, "grammars", None)
        # The group serving now (serve/resize.py replaces it when the group changes size).
        latency = (lambda: engine.sessions.group.gate_latency_us()) \
            if callable(getattr(getattr(engine.sessions, "group", None), "gate_latency_us", None)) else None
        self.metrics = ServeMetrics(engine, latency)
        self.created = int(time.time())
        self.cluster = None  # the leader's cluster page figures (serve/cluster.py's ClusterView)
        self.resize = None  # the group's size and state (serve/resize.py's ResizeStatus)
