"""Constrained decoding: a grammar (JSON Schema, JSON mode, a strict tool call) as a token mask
for the model's tokenizer, the same on both ranks.

The engine is llguidance (PyPI), chosen by a measurement on this project's tokenizers (the
demo's 512-token byte-level BPE and a 32000-token one; a 10-field schema with enums, bounded
strings and arrays, a nested object and a nullable field; Linux CPU, a shared machine):

  engine          compile (median)   mask per token (median)   schema keywords refused
  llguidance      2.0 / 2.2 ms       46 / 65 us                uniqueItems, not, if/then: named
  xgrammar        7.0 / 12 ms        21 / 17 us                none named: unsupported ones are
                                                               silently ignored; pulls in torch
  outlines-core   21 ms / 1.4 s      0.2 / 0.3 us (an index)   allOf, not, if/then

llguidance compiles lazily (a schema costs milliseconds whatever the vocabulary, where
outlines-core builds its whole index up front), names the keyword it cannot compile (our 400),
takes its tokenizer from the Hugging Face one mlx-lm loads, embeds a JSON Schema in a Lark
grammar (a tool call between the tokenizer's markers) and needs nothing but numpy. Its mask
costs tens of microseconds a token on the host, beside a decode step of milliseconds.

The grammar text travels with the session's sampling options (SAMPLER), and each rank builds
its own matcher from it and advances it with the tokens it drew itself, which are the same
tokens on both ranks (the lockstep token hash checks them): so both ranks mask the same logits
alike and draw the same token, with no mask on the wire.

A tool call's grammar (in the model's own format, its markers as its tokenizer holds them) is
serve.dialects.tool_calls.call_grammar's.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Dict, Tuple

import mlx.core as mx
import numpy as np

from ..errors import GrammarError

# JSON written compactly: no free whitespace between tokens, so the model cannot spend its
# budget on blanks and a schema's bounds bound the text.
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
# Compiled grammars kept (by grammar text) per tokenizer.
CACHE_GRAMMARS = 64
# The longest cause a GrammarError quotes from the engine (its first line).
MAX_CAUSE_CHARS = 300


def with_compact(schema: Dict[str, Any]) -> Dict[str, Any]:
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON Schema must be an object, not {type(schema).__name__}")
    schema = dict(schema)
    schema["x-guidance"] = dict(COMPACT)
    return schema


def json_schema_grammar(schema: Dict[str, Any]) -> str:
    """The grammar of JSON text that validates against `schema` (written compactly)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(with_compact(schema))


def json_object_grammar() -> str:
    """JSON mode: any JSON object."""
    return json_schema_grammar({"type": "object"})


def _cause(error: str) -> str:
    """The engine's error in one line: its first, without the matcher's state dump after it."""
    line = (error or "").strip().split("\n", 1)[0].strip()
    return line[:MAX_CAUSE_CHARS] + ("..." if len(line) > MAX_CAUSE_CHARS else "")


class RowGrammar:
    """One row's matcher: the tokens its grammar allows next, advanced token by token."""

    def __init__(self, matcher, engine, special: np.ndarray, vocab: int):
        import llguidance.numpy as lln

        self.matcher = matcher
        self.vocab = vocab  # the model's logits; ids past the tokenizer's are never allowed
        self._engine = engine  # llguidance's tokenizer
        self._special = special[special < vocab]  # the ids it takes for tokens of their own
        self._ends = set(engine.eos_tokens)
        self._words = lln.allocate_token_bitmask(1, engine.vocab_size)
        self._fill = lln.fill_next_token_bitmask

    def allowed(self) -> mx.array:
        """[vocab] bool: the tokens the grammar allows next (only EOS once it is complete);
        GrammarError when it allows none (its matcher failed)."""
        self._fill(self.matcher, self._words, 0)
        bits = np.unpackbits(self._words[0].view(np.uint8), bitorder="little")[: self.vocab]
        if len(bits) < self.vocab:
            bits = np.concatenate([bits, np.zeros(self.vocab - len(bits), dtype=bits.dtype)])
        self._refit_forced(bits)
        if not bits.any():
            raise GrammarError(f"the grammar allows no token: {_cause(self.matcher.get_error()) or 'it is stopped'}")
        return mx.array(bits.astype(np.bool_))

    def _refit_forced(self, bits: np.ndarray) -> None:
        """Where the grammar forces bytes that an added token spells (`<tool_call>` inside a JSON
        string, written as text), llguidance's mask allows that token alone, which its matcher
        then refuses (the token is not those bytes to it). Such a token is taken out, and the
        first ordinary token of the forced bytes put in its place."""
        hits = self._special[bits[self._special] != 0].tolist()
        # EOS fits where the grammar is complete (where it is stopped, validating refuses it).
        unfit = [t for t in hits if not (self.matcher.is_accepting() if t in self._ends
                                         else self.matcher.validate_tokens([t]) == 1)]
        if not unfit:
            return
        bits[unfit] = 0
        if not bits.any():
            # The engine's own tokenizing splits the added token off again; its greedy one,
            # over the vocabulary's ordinary tokens, does not.
            forced = self.matcher.compute_ff_bytes().decode("utf-8", "ignore")
            plain = self._engine.greedy_tokenize(forced) if forced else []
            if plain and plain[0] < len(bits) and self.matcher.validate_tokens(plain[:1]) == 1:
                bits[plain[0]] = 1

    def consume(self, token: int) -> None:
        """Advance past a drawn token; GrammarError when the grammar does not allow it."""
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} does not fit the grammar: {_cause(self.matcher.get_error())}")


class Grammars:
    """The compiled grammars of one tokenizer, cached by grammar text (each row matches from
    a copy of its grammar's compiled matcher). Thread-safe: the HTTP threads check a request's
    grammar while the engine builds rows."""

    def __init__(self, tokenizer):
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds HF's
        self._eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [])
        self._lock = threading.Lock()
        self._ll = None  # llguidance's tokenizer, built at the first grammar
        self._special = np.zeros(0, dtype=np.int64)  # the ids it takes for tokens of their own
        self._compiled: "collections.OrderedDict[str, Any]" = collections.OrderedDict()

    def _tokenizer(self):
        if self._ll is None:
            import llguidance.hf

            ll = llguidance.hf.from_tokenizer(self._hf, eos_token=self._eos or None)
            self._special = np.array([i for i in range(ll.vocab_size) if ll.is_special_token(i)], dtype=np.int64)
            self._ll = ll
        return self._ll

    def compile(self, grammar: str) -> float:
        """Compile `grammar` (or find it compiled): the seconds it took, 0.0 from the cache;
        GrammarError naming what the engine refused."""
        return self._matcher(grammar)[1]

    def _matcher(self, grammar: str) -> Tuple[Any, float]:
        import llguidance

        with self._lock:
            hit = self._compiled.get(grammar)
            if hit is not None:
                self._compiled.move_to_end(grammar)
                return hit, 0.0
            began = time.perf_counter()
            tokenizer = self._tokenizer()
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
            if is_error:
                raise GrammarError("; ".join(messages) or "the grammar does not compile")
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise GrammarError(_cause(matcher.get_error()))
            # A grammar that allows no first token (a token id the tokenizer lacks, ...) is
            # refused here, before the request has any token, not at its first draw.
            if not any(matcher.deep_copy().compute_bitmask()):
                raise GrammarError("the grammar allows no token at its start: "
                                   f"{_cause(matcher.get_error()) or 'nothing this tokenizer spells fits it'}")
            took = time.perf_counter() - began
            self._compiled[grammar] = matcher
            while len(self._compiled) > CACHE_GRAMMARS:
                self._compiled.popitem(last=False)
            return matcher, took

    def row(self, grammar: str, vocab: int) -> RowGrammar:
        """A fresh matcher of `grammar` for one row, at its start, masking `vocab` logits."""
        compiled, _ = self._matcher(grammar)
        with self._lock:
            return RowGrammar(compiled.deep_copy(), self._ll, self._special, vocab or self._ll.vocab_size)

