"""The pair secret a user makes once (`ds4tp pair` on one Mac, `ds4tp pair CODE` on the other):
a random code kept in the user's config directory, readable by the user only (mode 0600), which
both ranks prove in the hello's challenge-response (hello.authenticate) before they pair.

The code is what is stored and what the hello's key is made of: base32 (no 0/1/8/9 to misread),
in groups of four, 80 random bits; case, spaces and dashes do not count when it is typed back.
"""

from __future__ import annotations

import base64
import os
import secrets
import sys
from pathlib import Path
from typing import Mapping, Optional

from .config import SECRET_ENV

CODE_BYTES = 10  # 80 bits: 16 base32 characters
GROUP = 4
CONFIG_DIR_ENV = "DS4_TP_CONFIG_DIR"
SECRET_FILE = "pair-secret"


def new_code() -> str:
    """A fresh random code, e.g. 'K7QF-2MZA-XR4D-PLWE'."""
    return format_code(base64.b32encode(secrets.token_bytes(CODE_BYTES)).decode("ascii"))


def format_code(raw: str) -> str:
    """`raw`'s characters in groups of four, upper case."""
    text = raw.upper()
    return "-".join(text[i:i + GROUP] for i in range(0, len(text), GROUP))


def parse_code(text: str) -> str:
    """The code typed back (any case, spaces or dashes anywhere) in its stored form; a
    ValueError naming what is wrong with it otherwise."""
    raw = "".join(ch for ch in text.upper() if ch != "-" and not ch.isspace())
    want = len(base64.b32encode(bytes(CODE_BYTES)))
    if len(raw) != want:
        raise ValueError(f"pair code {text!r} has {len(raw)} characters, not {want}: type the code "
                         "`ds4tp pair` printed on the other Mac (e.g. K7QF-2MZA-XR4D-PLWE)")
    try:
        base64.b32decode(raw)
    except ValueError:
        raise ValueError(f"pair code {text!r} has characters a code never has (only A-Z and 2-7): "
                         "type the code `ds4tp pair` printed on the other Mac") from None
    return format_code(raw)


def config_dir(env: Optional[Mapping[str, str]] = None, platform: str = sys.platform) -> Path:
    """DS4_TP_CONFIG_DIR, else the user's config directory: ~/Library/Application Support/ds4tp
    on macOS, $XDG_CONFIG_HOME/ds4tp (~/.config/ds4tp) elsewhere."""
    env = os.environ if env is None else env
    if env.get(CONFIG_DIR_ENV):
        return Path(env[CONFIG_DIR_ENV])
    home = Path(env.get("HOME") or Path.home())
    if platform == "darwin":
        return home / "Library" / "Application Support" / "ds4tp"
    return Path(env.get("XDG_CONFIG_HOME") or home / ".config") / "ds4tp"


def secret_path(env: Optional[Mapping[str, str]] = None) -> Path:
    return config_dir(env) / SECRET_FILE


def store_code(code: str, env: Optional[Mapping[str, str]] = None) -> Path:
    """Write the code (checked) as this user's pair secret, mode 0600 from its creation on;
    returns the file's path."""
    code = parse_code(code)
    path = secret_path(env)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(code + "\n")
    os.chmod(tmp, 0o600)  # an existing tmp file keeps its old mode through O_CREAT
    os.replace(tmp, path)
    return path


def stored_code(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The stored pair secret's code, or None when there is none. A file others can read is
    refused (ValueError naming the fix): the secret it holds is no longer the pair's alone."""
    path = secret_path(env)
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        return None
    if mode & 0o077:
        raise ValueError(f"{path} is readable by other users (mode {mode:o}): run "
                         f"`chmod 600 '{path}'`, or make a new secret with `ds4tp pair` on both Macs")
    return parse_code(path.read_text())


def join_secret(given: Optional[str], env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The secret a rank proves, one resolution for every way of joining (explicit addresses
    and discovery alike): `given` (--secret), else DS4_TP_SECRET, else the code `ds4tp pair`
    stored; None when there is none. A ValueError when the stored file is readable by others."""
    env = os.environ if env is None else env
    if given is not None:
        return given
    if env.get(SECRET_ENV):
        return env[SECRET_ENV]
    return stored_code(env)
