"""`--model`, defined once for every command that takes it; for `ds4tp run` and `ds4tp serve`
an mlx-lm model directory, a Hugging Face repo id already downloaded, or `demo` (the demo's
small synthetic model, built once into the cache); and the short id `ds4tp serve` serves it
under."""

from __future__ import annotations

import argparse
from pathlib import Path

DEMO = "demo"
MODEL_HELP = ("an mlx-lm model directory, a Hugging Face repo id (the leader downloads one it lacks; "
              "a worker given --role worker --coordinator may leave --model out and receive its part "
              "from the leader), or 'demo': a small model with synthetic random weights, "
              "built once into ~/.cache/mlx_ds4tp, or $XDG_CACHE_HOME/mlx_ds4tp (./demo for a "
              "directory of that name)")


def add_model_arg(p: argparse.ArgumentParser, help_text: str = MODEL_HELP, required: bool = True,
                  metavar: str = "MODEL") -> None:
    """--model, the one definition every command's --model is; help_text says what this
    command does with it."""
    p.add_argument("--model", required=required, default=None, metavar=metavar, help=help_text)


def model_path(model: str, download: bool = False) -> Path:
    """The directory `--model` names; exits naming the value and the fix when there is none.
    download: a Hugging Face repo id not on this machine is downloaded (a leader's --model)."""
    if model == DEMO:
        from ..synthetic.demo_model import demo_model_dir

        return demo_model_dir()
    from ..checkpoint.source import resolve_model_arg

    return resolve_model_arg(model, download)


def default_served_name(model: str) -> str:
    """mlx-lm's model id convention: 'demo' for the demo model, the repo id for a Hugging
    Face repo id, the directory's own name for a path."""
    if model == DEMO:
        return DEMO
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve().name
    return model
