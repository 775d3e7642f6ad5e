"""A leader's sessions without a pair or a model, for the serving engine's parts on their own.

FakeSessions keeps what LeaderSessions would send to the worker (`commands`) and plays a model
whose next token after token t is (t + 1) % VOCAB: its decode logits put the most weight on
that token, and a sampled step draws it (EVAL_PENDING rows continue from their own last draw,
as a rank's table does). FakeTokenizer spells token t as one letter, so texts are easy to read.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_ds4tp.lockstep.protocol.commands import EVAL_PENDING
from mlx_ds4tp.lockstep.protocol.sessions import SampledStep

VOCAB = 26
EOS = 25


def next_token(token: int) -> int:
    return (token + 1) % VOCAB


def letters(tokens) -> str:
    return "".join(chr(ord("a") + t) for t in tokens)


class _Detokenizer:
    def __init__(self):
        self.reset()

    def reset(self):
        self.tokens, self.sent = [], 0

    def add_token(self, token):
        self.tokens.append(token)

    def finalize(self):
        pass

    @property
    def last_segment(self):
        text, self.sent = letters(self.tokens[self.sent:]), len(self.tokens)
        return text


class FakeTokenizer:
    eos_token_ids = [EOS]

    @property
    def detokenizer(self):
        return _Detokenizer()

    def decode(self, tokens):
        return letters(tokens)


class _Caches:
    def __init__(self):
        self.stored, self.sessions = {}, {}
        self.disk = None  # no --prompt-cache-dir

    def make_cache(self):
        return []  # no layers: trimmable, as a float KV cache is

    def stored_bytes(self, cache_id):
        return 100


class _Batch:
    def __init__(self):
        self.samplers, self.rows = {}, []


class _Table:
    def __init__(self):
        self.caches, self.batch = _Caches(), _Batch()
        self.vocab = VOCAB

    def row_grammar(self, grammar: str):
        assert not grammar, "the engine fakes decode without grammars (tests/test_structured.py has them)"
        return None


class _Sampler:
    keep_logprobs = False


def _logits(tokens) -> mx.array:
    """Decode logits [rows, VOCAB] whose argmax after token t is next_token(t)."""
    rows = [[5.0 if v == next_token(t) else 0.0 for v in range(VOCAB)] for t in tokens]
    return mx.array(rows)


class FakeSessions:
    """LeaderSessions' commands, recorded (see the module docstring)."""

    def __init__(self):
        self.table = _Table()
        self.commands = []
        self.pending = {}  # session -> this "rank's" last sampled token

    def send(self, command, *fields):
        """LeaderSessions.send: the command recorded and played on the fake table."""
        return getattr(self, "_" + command.__name__.lower())(*fields)

    @property
    def step_count(self):
        return self.steps

    steps = 0  # decode steps sent (EVAL_BATCH, VERIFY_BATCH)

    def _create(self, session, cache_id, mode, kv):
        self.commands.append(("create", session, cache_id, mode))
        self.table.caches.sessions[session] = cache_id

    def _rewind(self, session, keep, _reserved):
        self.commands.append(("rewind", session, keep))

    def _sampler(self, session, options, prompt, seed):
        self.commands.append(("sampler", session))
        self.table.batch.samplers[session] = _Sampler()

    def _prefillbatch(self, rows):
        self.commands.append(("prefill", [(s, list(t)) for s, t in rows]))

    def _evalbatch(self, step, rows):
        self._stepped(step)
        self.commands.append(("step", list(rows)))
        return _logits([t for _, t in rows])

    def sampled_step(self, rows):
        self._stepped(self.steps + 1)
        self.commands.append(("sampled_step", list(rows)))
        drawn = []
        for session, token in rows:
            base = self.pending[session] if token == EVAL_PENDING else token
            self.pending[session] = next_token(base)
            drawn.append(self.pending[session])
        return SampledStep(mx.array(drawn, dtype=mx.int32), {}, [None] * len(rows))

    def _verifybatch(self, step, rows):
        self._stepped(step)
        self.commands.append(("verify", [(s, list(t)) for s, t in rows]))
        width = max(len(t) for _, t in rows)
        return mx.stack([_logits(list(t) + [t[-1]] * (width - len(t))) for _, t in rows])

    def _commitbatch(self, step, keep):
        assert step == self.steps, f"COMMIT_BATCH of step {step} after step {self.steps}"
        self.commands.append(("commit", list(keep)))

    def _stepped(self, step):
        assert step == self.steps + 1, f"decode step {step} sent after step {self.steps}"
        self.steps = step

    def _destroy(self, session, store_as):
        self.commands.append(("destroy", session, store_as))
        if store_as:
            self.table.caches.stored[store_as] = session

    def _invalidate(self, cache_id):
        self.commands.append(("invalidate", cache_id))
        del self.table.caches.stored[cache_id]

    def check_hash(self):
        self.commands.append(("hash",))

    # -- what LeaderSessions answers from its table ----------------------------------------
    vocab = VOCAB

    @property
    def disk(self):
        return self.table.caches.disk

    def caches_trim(self):
        return True  # no layers: trimmable, as a float KV cache is

    def stored_bytes(self, cache_id):
        return self.table.caches.stored_bytes(cache_id)

    def counts(self):
        return len(self.table.caches.sessions), len(self.table.caches.stored)

    def row_sampler(self, session):
        return self.table.batch.samplers[session]

    def row_grammar(self, grammar):
        return self.table.row_grammar(grammar)

    def read(self, tokens):
        return tokens.tolist()

    def kinds(self):
        return [c[0] for c in self.commands]

    def peer_gone(self):
        return self.gone

    gone = None  # why the worker is gone, as peer_gone says it between commands

    def abort(self, reason):
        self.commands.append(("abort", reason))

    def stop(self):
        self.commands.append(("stop",))


def fake_batch(speculation=None, **settings):
    """The leader's batch (lockstep.batch.Batch) over recorded sessions; settings: BatchSettings'."""
    from mlx_ds4tp.lockstep.batch import Batch, BatchSettings

    sessions = FakeSessions()
    return Batch(sessions, BatchSettings(**settings), speculation), sessions
