"""Every tool-call format mlx-lm's tokenizer wrapper knows (its tool_parsers modules), as the
grammar of one call: what a call writes between the opening and closing markers, so that the
format's own parser reads it back into the tool's name and arguments that validate against the
tool's parameters schema (any object for a tool that is not strict).

  base.py       markers as tokens or text, JSON values, raw text values up to a closing marker
  json_args.py  json_tools, mistral, kimi_k2, kimi_k3: the arguments one JSON object
  blocks.py     qwen3_coder, glm47 (laguna), longcat, minimax_m2, minicpm5, muse_spark: a block
                a parameter, each value typed by its schema as the parser reads it
  literals.py   pythonic, function_gemma, gemma4: a function applied to literals
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

from . import blocks, json_args, literals
from .base import CallFormat

CallRules = Callable[[CallFormat, str, str, str, Dict[str, Any]], List[str]]

# mlx-lm's parser -> (the markers a call writes inside it, the rules of one call to one tool;
# None for json_tools and mistral, whose calls are one JSON object, all tools in one schema).
FORMATS: Dict[str, Tuple[Tuple[str, ...], Any]] = {
    "json_tools": ((), None),
    "mistral": ((), None),
    "kimi_k2": (json_args.KIMI_K2_MARKS, json_args.kimi_k2_call),
    "kimi_k3": (json_args.KIMI_K3_MARKS, json_args.kimi_k3_call),
    "pythonic": ((), literals.pythonic_call),
    "function_gemma": ((literals.ESCAPE,), literals.function_gemma_call),
    "gemma4": ((literals.QUOTE,), literals.gemma4_call),
    **{name: (blocks.MARKS.get(name, ()), blocks.block_call) for name in blocks.FORMATS},
}


def call_rules(calls: Sequence[Tuple[str, Dict[str, Any]]], fmt: CallFormat) -> List[str]:
    """The rules of `call`: one call, in `fmt`, to one of `calls` (name, parameters schema)."""
    _, one = FORMATS[fmt.parser]
    if one is None:
        return json_args.named_object_rules(calls, fmt)
    names = [f"call_{i}" for i in range(len(calls))]
    rules = [f"call: {fmt.start} ({' | '.join(names)}) {fmt.end}".rstrip()]
    for i, (rule, (name, params)) in enumerate(zip(names, calls)):
        rules += one(fmt, rule, f"c{i}", name, params)
    return rules
