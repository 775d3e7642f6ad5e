"""The ``ds4tp`` command line (``python -m mlx_ds4tp`` is the same).

Each command is its own module here, as mlx-lm's are: `HELP`, `add_args(parser)`, its checks,
and `main(args)`. A flag several commands take is defined once, in its helper module
(pair_args, model_arg, sampling_args, draft_args); the command checks its flags once and makes
typed settings objects of them (LinkSettings, ServeSettings, ...), which are what the layers
below take: no module below cli/ sees the argparse namespace.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Optional, Sequence

from ..base.log import log
from ..errors import TransportError

# Command name -> module (mlx_ds4tp.cli.<module>), in the order `ds4tp --help` lists them.
COMMANDS = {"run": "run", "serve": "serve", "pair": "pair_code", "demo": "demo", "bench": "bench",
            "doctor": "doctor"}


def build_parser() -> argparse.ArgumentParser:
    """The `ds4tp` parser: one sub-parser per command, built by the command's own module."""
    parser = argparse.ArgumentParser(
        prog="ds4tp", description="One MLX model split 50/50 across two machines. `ds4tp demo` "
        "runs both ranks here; `ds4tp COMMAND --help` says what each command takes.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"{__name__}.{module_name}")
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_args(p)
        p.set_defaults(func=module.main)
    return parser


def report_errors(fn: Callable[[], int]) -> int:
    """fn's exit code; a transport, value or runtime error becomes one
    `ds4-tp: error:` line on stderr and exit code 1, Ctrl-C exit code 130."""
    try:
        return fn()
    except KeyboardInterrupt:
        return 130
    except (TransportError, ValueError, RuntimeError) as exc:
        log(f"error: {exc}")
        return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The `ds4tp` command: parse argv (default sys.argv) and run the subcommand."""
    args = build_parser().parse_args(argv)
    return report_errors(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
