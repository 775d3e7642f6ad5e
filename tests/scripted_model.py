"""A tiny llama whose greedy output is scripted: a known sequence of tokens, whatever the prompt.

Its tokenizer adds one token per piece of the script (reasoning tags, a tool call in the
json_tools format Qwen-style templates use, ...). The model's blocks add nothing (their output
projections are zero), so the logits depend on the current token alone: the embedding is one-hot
and `lm_head` maps each token to its successor, the script's next piece. The prompt's last token
(the newline that opens the assistant's turn) leads into the script's first piece; the script ends
in EOS. Every piece is a distinct token, so the chain is unambiguous.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_ds4tp.synthetic.tiny_model import EOS_ID, save_random_model, save_tokenizer

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
SCRIPT = ["<think>", "The user wants the weather.", "</think>", "<tool_call>", json.dumps(CALL),
          "</tool_call>"]
# A Qwen-style template: tools listed in a system turn, calls as <tool_call>{json}</tool_call>,
# tool results as their own turn; "tool_call.name" names mlx-lm's json_tools parser.
TOOLS_TEMPLATE = (
    "{% if tools %}<s>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}\n"
    "{% if m.get('tool_calls') %}{% for tool_call in m['tool_calls'] %}"
    "{% set tool_call = tool_call.function %}<tool_call>{\"name\": \"{{ tool_call.name }}\", "
    "\"arguments\": {{ tool_call.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% elif m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
    "{% else %}{{ m['content'] }}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
VOCAB_BASE = 384


def token_id(piece: str) -> int:
    """The id of one piece of the script in the scripted model's tokenizer."""
    return VOCAB_BASE + SCRIPT.index(piece)


def build(directory: Path, script=SCRIPT) -> Path:
    """Save the scripted model under directory/scripted and return its path."""
    from tokenizers import AddedToken, Tokenizer

    path = save_random_model(directory / "scripted", {
        "model_type": "llama", "hidden_size": 512, "num_hidden_layers": 1, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_BASE + len(script), "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False})
    # The tokenizer: VOCAB_BASE byte-level tokens, then one token per piece of the script.
    save_tokenizer(path, VOCAB_BASE)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    pieces = {}
    for piece in script:
        tok.add_tokens([AddedToken(piece, normalized=False, special=False)])
        pieces[piece] = tok.token_to_id(piece)
    tok.save(str(path / "tokenizer.json"))
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_path.write_text(json.dumps(config))
    vocab = VOCAB_BASE + len(script)
    assert sorted(pieces.values()) == list(range(VOCAB_BASE, vocab)), pieces

    # The weights: blocks that add nothing, a one-hot embedding, lm_head as the successor map.
    from mlx_lm.utils import load_model, save_model

    model, _ = load_model(path)
    hidden = model.args.hidden_size
    embed = np.zeros((vocab, hidden), np.float32)
    embed[np.arange(vocab), np.arange(vocab)] = 1.0
    head = np.zeros((vocab, hidden), np.float32)
    successor = {t: EOS_ID for t in range(vocab)}
    newline = tok.token_to_id("Ċ")  # byte-level BPE's newline, the prompt's last token
    chain = [newline] + [pieces[p] for p in script] + [EOS_ID]
    for here, after in zip(chain, chain[1:]):
        successor[here] = after
    for here, after in successor.items():
        head[after, here] = 1.0
    weights = {"model.embed_tokens.weight": mx.array(embed), "lm_head.weight": mx.array(head)}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            key = f"model.layers.{i}.{name}"
            weights[key] = mx.zeros_like(dict(_flat(model))[key])
    model.load_weights(list(weights.items()), strict=False)
    save_model(path, model, donate_model=True)
    return path


def _flat(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())
