"""`ds4tp pair`: make the pair secret once. On one Mac `ds4tp pair` creates it and prints it as a
short code; on the other `ds4tp pair CODE` stores the same. Both keep it in the user's config
directory (mode 0600), and every rank proves it in the hello, at an address or finding its peer
by itself (--secret and DS4_TP_SECRET take precedence); a peer without it is refused on both
sides, by name."""

from __future__ import annotations

import argparse

from ..base.log import log

HELP = "make the pair secret once: `ds4tp pair` on one Mac, `ds4tp pair CODE` on the other"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("code", nargs="?", default=None,
                   help="the code `ds4tp pair` printed on the other Mac (omit it to make a new one)")
    p.add_argument("--force", action="store_true",
                   help="replace a stored secret with a new one (the other Mac then needs the new code)")


def main(args: argparse.Namespace) -> int:
    from ..link.pair_secret import new_code, store_code, stored_code

    if args.code is not None:
        try:
            path = store_code(args.code)
        except ValueError as exc:
            raise SystemExit(f"ds4tp pair: {exc}") from None
        log(f"pair secret stored in {path}; this Mac pairs with the one that printed the code")
        return 0
    code = None if args.force else stored_code()
    if code is None:
        code = new_code()
        path = store_code(code)
        log(f"a new pair secret is stored in {path}")
    else:
        log("this Mac already has a pair secret (`ds4tp pair --force` makes a new one)")
    print(code, flush=True)
    log(f"on the other Mac run: ds4tp pair {code}")
    return 0
