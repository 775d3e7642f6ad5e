"""The pair secret looked for in what a served group shows (issue 61: the secret never appears in
a log, an error or an HTTP body): every printable form of it, each rank's output and each HTTP
answer the serve helpers (serveutil.py) read, recorded as they are read and searched when the
group is closed, the place it was found named.

The code makes no printable form of its own from the secret (hello, JOIN and lobby proofs are
HMACs over fresh nonces), so the forms are the ones a careless line would write: the text as
given, a pair code's characters without dashes, in any case, its UTF-8 bytes in hex and in
base64 (what `repr(bytes)`, `.hex()` or a JSON encoder of bytes would print)."""

from __future__ import annotations

import base64
import importlib
from typing import Dict, Iterable, List, Optional

# Pair-code shaped (as `ds4tp pair` makes them), so its stored and typed forms are looked for too.
TEST_SECRET = "QZ7K-W3XV-MT5P-JH2R"


def secret_forms(secret: str) -> Dict[str, str]:
    """Every printable form of `secret` a leak could take: {what it is: text}."""
    raw = secret.encode("utf-8")
    forms = {"as given": secret, "in hex": raw.hex(),
             "in base64": base64.b64encode(raw).decode("ascii").rstrip("="),
             "in urlsafe base64": base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")}
    if "-" in secret:
        forms["without its dashes"] = secret.replace("-", "")
    return forms


def find_secret(secrets: Iterable[str], text: str, where: str) -> List[str]:
    """'where line N: the line (form)' for each line of `text` holding a form of a secret, in
    any case."""
    found = []
    for secret in secrets:
        forms = secret_forms(secret)
        for n, line in enumerate(text.splitlines(), 1):
            hits = [what for what, form in forms.items() if form in line or form.lower() in line.lower()]
            if hits:
                found.append(f"{where} line {n}: {line[:300]!r} (the secret {', '.join(hits)})")
    return found


class BodyRecord:
    """The HTTP answers a served group's helpers read: each its place (method and path) and its
    bytes, a streamed one growing as its chunks are read."""

    def __init__(self):
        self.bodies: List[tuple] = []

    def add(self, where: str, body: Optional[bytes] = b"") -> bytearray:
        kept = bytearray(body or b"")
        self.bodies.append((where, kept))
        return kept

    def leaks(self, secrets: Iterable[str]) -> List[str]:
        secrets = list(secrets)
        found = []
        for where, body in self.bodies:
            found += find_secret(secrets, bytes(body).decode("utf-8", "replace"), f"HTTP body of {where}")
        return found


def tapped_http_client(record: BodyRecord, sdk=None):
    """The `sdk`'s own httpx client (the openai or anthropic module; openai when None), its
    defaults kept, whose every answer's bytes are added to `record` as they are read: streamed
    answers included, never buffered ahead of the caller."""
    if sdk is None:
        import openai as sdk

    # The SDKs build on httpx or its httpx2 fork, by version: the tap speaks the one they use.
    httpx = importlib.import_module(sdk.DefaultHttpxClient.__mro__[1].__module__.split(".")[0])

    class TappedStream(httpx.SyncByteStream):
        def __init__(self, inner, kept: bytearray):
            self.inner, self.kept = inner, kept

        def __iter__(self):
            for chunk in self.inner:
                self.kept += chunk
                yield chunk

        def close(self) -> None:
            self.inner.close()

    class Tap(httpx.BaseTransport):
        def __init__(self):
            self.inner = httpx.HTTPTransport()

        def handle_request(self, request):
            response = self.inner.handle_request(request)
            response.stream = TappedStream(response.stream, record.add(f"{request.method} {request.url.path}"))
            return response

        def close(self) -> None:
            self.inner.close()

    return sdk.DefaultHttpxClient(transport=Tap())
