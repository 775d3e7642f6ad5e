"""`ds4tp bench --serve`'s structured-output figures: one client's decode tok/s constrained by a
JSON Schema against the same client unconstrained, in the same run on the same server, and the
grammar compile time of that schema (first and cached) with the server's engine and tokenizer.

The schema is a typical 10-field object (enums, booleans, bounded integers, a nested object,
a bounded array, a nullable field) whose last field is a string of fixed length, so a
constrained answer is long enough to time its decode as the unconstrained one is timed.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable, Dict, Optional

_SHORT = {"type": "string", "maxLength": 12}
BENCH_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "name": _SHORT,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "email": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": _SHORT, "maxItems": 3},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": _SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "nickname": {"anyOf": [_SHORT, {"type": "null"}]},
        "level": {"type": "integer", "minimum": 1, "maximum": 9},
        "notes": {"type": "string", "minLength": 400, "maxLength": 400},
    },
}
BENCH_SCHEMA["required"] = list(BENCH_SCHEMA["properties"])


def response_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": BENCH_SCHEMA, "strict": True}}


def compile_figures(model: Path) -> Dict[str, float]:
    """The grammar compile time of BENCH_SCHEMA with this model's tokenizer: the first compile
    (after the engine's tokenizer is built) and the second, from the cache."""
    from mlx_lm.utils import load_tokenizer

    from ..lockstep.sampling.grammar import Grammars, json_schema_grammar

    grammars = Grammars(load_tokenizer(Path(model)))
    grammars.compile(json_schema_grammar({"type": "object"}))  # builds the engine's tokenizer
    began = time.perf_counter()
    first = grammars.compile(json_schema_grammar(BENCH_SCHEMA))
    took = time.perf_counter() - began
    return {"compile_ms": 1000.0 * first, "compile_with_schema_ms": 1000.0 * took,
            "compile_cached_ms": 1000.0 * grammars.compile(json_schema_grammar(BENCH_SCHEMA))}


def measure_constrained(one: Callable[[Optional[dict]], Dict[str, float]], rounds: int) -> Dict[str, float]:
    """`one(extra body or None)` streams one request and returns its figures (bench.serve);
    plain and constrained requests alternate, `rounds` each, and the medians are kept."""
    plain, constrained = [], []
    for _ in range(max(rounds, 1)):
        for extra, out in ((None, plain), ({"response_format": response_format()}, constrained)):
            r = one(extra)
            if r["tokens"] > 1 and r["last"] > r["first"]:
                out.append((r["tokens"] - 1) / (r["last"] - r["first"]))
    if not plain or not constrained:
        raise RuntimeError("the structured-output bench's answers were too short to time their decode")
    p, c = statistics.median(plain), statistics.median(constrained)
    return {"name": "serve-json", "clients": 1, "plain_decode_tok_s": p, "constrained_decode_tok_s": c,
            "constrained_over_plain": c / p}


def line(rec: Dict[str, float]) -> str:
    """The record as `ds4tp bench --serve` prints it."""
    text = (f"{rec['name']:>10}  decode {rec['constrained_decode_tok_s']:8.1f} tok/s constrained (JSON Schema)"
            f" vs {rec['plain_decode_tok_s']:8.1f} tok/s plain = {rec['constrained_over_plain']:.2f}x")
    if "compile_ms" in rec:
        text += (f"  grammar compile {rec['compile_ms']:.1f} ms (cached {rec['compile_cached_ms']:.3f} ms)")
    return text
