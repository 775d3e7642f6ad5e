"""Helpers for the `ds4tp serve` tests: a tiny model with a chat template, a served pair as two
real processes (always killed), and mlx-lm's own generation as the reference.

Every served group proves a pair secret (TEST_SECRET, unless a test gives its own or None), and
its close() searches every rank's output and every HTTP answer these helpers read for it
(secret_grep.py): issue 61's "no secret in a log, an error or an HTTP body", checked by every
serve test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Optional

from pairutil import REPO, free_port
from secret_grep import TEST_SECRET, BodyRecord, find_secret, tapped_http_client

# A plain template: role line, content, end of turn; the assistant's turn left open.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
API_KEY = "test-key"
# ServedPair's env for a group without any secret (loopback needs none).
NO_SECRET = {"DS4_TP_SECRET": None}


def build_chat_model(directory: Path, seed: int = 3, preset: str = "tiny") -> Path:
    """The tiny llama (or another preset: tiny8 for more than two ranks) with a chat template
    in its tokenizer config."""
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    path = save_llama(directory / "chat-llama", preset, seed=seed)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return path


class ServedPair:
    """`ds4tp serve` leader and worker on 127.0.0.1, logs in files under `logs`; `model` is
    what both ranks get as --model (a directory, or "demo"). ranks > 2: --ranks N to the
    leader (the workers learn N from it; rank_extra gives a worker its own), the workers named
    "worker", "worker2", ...

    Every rank proves TEST_SECRET (DS4_TP_SECRET in its environment) unless `env`, `rank_env`
    or a --secret flag gives it another; `env` NO_SECRET: none at all, no stored code either
    (loopback needs none). close() fails naming every place a secret given to any rank shows up
    in a rank's output or an HTTP answer read through this module's helpers."""

    def __init__(self, model, logs: Path, extra: List[str] = (), env: Optional[dict] = None,
                 api_key: Optional[str] = API_KEY, rank_extra: Optional[dict] = None,
                 rank_env: Optional[dict] = None, ranks: int = 2):
        self.port = free_port()
        pair_port = free_port()
        self.logs = logs
        self.bodies = BodyRecord()
        self.secrets = set()
        self._searched = False
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = REPO + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.setdefault("DS4_TP_TIMEOUT_SEC", "20")
        full_env["DS4_TP_SECRET"] = TEST_SECRET
        full_env.update(env or {})
        for name in [name for name, value in full_env.items() if value is None]:  # NO_SECRET's
            del full_env[name]
        if "DS4_TP_SECRET" not in full_env:  # nor a code `ds4tp pair` stored for this user
            (logs / "no-pair-secret").mkdir(parents=True, exist_ok=True)
            full_env.setdefault("DS4_TP_CONFIG_DIR", str(logs / "no-pair-secret"))
        transport = ["--transport", "tcp"] if "--transport" not in extra else []
        common = [sys.executable, "-m", "mlx_ds4tp", "serve", "--model", str(model), *transport, *extra]
        key = ["--api-key", api_key] if api_key else []
        sized = ["--ranks", str(ranks)] if ranks != 2 else []
        # A lost worker is waited for (the tests of its restart), unless a test shrinks the group.
        sized += ["--shrink-after", "0"] if "--shrink-after" not in extra else []
        cmds = {
            "leader": common + key + sized + ["--role", "leader", "--listen", "127.0.0.1", str(pair_port),
                                              "--port", str(self.port)],
            "worker": common + ["--role", "worker", "--coordinator", "127.0.0.1", str(pair_port)],
        }
        for n in range(2, ranks):
            cmds[f"worker{n}"] = list(cmds["worker"])
        for name, more in (rank_extra or {}).items():  # flags of one rank only
            cmds[name] += list(more)
        # The environment of each rank: the common one, plus `rank_env`'s for that rank only.
        self.envs = {name: {**full_env, **(rank_env or {}).get(name, {})} for name in cmds}
        self.cmds = cmds
        self.procs = {}
        for name in cmds:
            self.start(name)
        self.base = f"http://127.0.0.1:{self.port}"

    def start(self, name: str, extra: List[str] = ()) -> None:
        """Start rank `name` ("leader" or "worker") with its command line (plus `extra`), its
        output appended to its log: a first start, or a restart after kill()."""
        out = open(self.logs / f"{name}.log", "a")
        cmd = self.cmds[name] + list(extra)
        # Whatever secret this rank is given is one the search looks for.
        self.secrets |= {self.envs[name].get("DS4_TP_SECRET")} - {None, ""}
        self.secrets |= {cmd[i + 1] for i, arg in enumerate(cmd[:-1]) if arg == "--secret"}
        self.procs[name] = subprocess.Popen(cmd, env=self.envs[name], stdout=out, stderr=subprocess.STDOUT)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def health(self) -> tuple:
        """(status code, body) of GET /health; (0, None) while nothing listens."""
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=10) as r:
                return r.status, json.loads(self.read_body("GET /health", r))
        except urllib.error.HTTPError as e:
            return e.code, json.loads(self.read_body("GET /health", e))
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, None

    def read_body(self, where: str, response) -> bytes:
        """`response`'s whole body, kept for close()'s search for the secret."""
        body = response.read()
        self.bodies.add(where, body)
        return body

    def wait_healthy(self, within: float = 90.0) -> dict:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise AssertionError(f"the {name} exited with {p.returncode}:\n{self.log(name)}")
            code, body = self.health()
            if code == 200:
                return body
            time.sleep(0.2)
        raise AssertionError(f"the server was not healthy within {within} s:\n{self.log('leader')}")

    def stop(self, within: float = 60.0) -> None:
        """Stop the pair as Ctrl-C does (SIGTERM to the leader, which tells the worker) and wait
        for both to exit; AssertionError naming a rank that does not."""
        self.procs["leader"].send_signal(signal.SIGTERM)
        for name, p in self.procs.items():
            try:
                p.wait(within)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the {name} did not stop within {within} s:\n{self.log(name)}") from None

    def kill(self, name: str) -> None:
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(10)

    def close(self) -> None:
        """Every rank killed, then every rank's output and every HTTP answer read searched for
        the secret: an AssertionError naming each place it was found (once)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)
        if self._searched:
            return
        self._searched = True
        leaks = self.leaks()
        assert not leaks, "the pair secret shows where it must not (issue 61):\n" + "\n".join(leaks)

    def leaks(self) -> List[str]:
        """Each place a secret given to a rank shows up: a line of a rank's log (its stdout and
        stderr) or of an HTTP answer read through this module."""
        found = []
        for name in self.procs:
            found += find_secret(self.secrets, self.log(name), f"{self.logs / (name + '.log')}")
        return found + self.bodies.leaks(self.secrets)


def client(pair: ServedPair, api_key: str = API_KEY, timeout: float = 60.0):
    import openai

    return openai.OpenAI(base_url=pair.base + "/v1", api_key=api_key, max_retries=0, timeout=timeout,
                         http_client=tapped_http_client(pair.bodies))


def anthropic_client(pair: ServedPair, api_key: str = API_KEY, timeout: float = 60.0):
    """The anthropic SDK's client of the pair, its answers kept for close()'s search."""
    import anthropic

    return anthropic.Anthropic(base_url=pair.base, api_key=api_key, max_retries=0, timeout=timeout,
                               http_client=tapped_http_client(pair.bodies, anthropic))


def open_stream(pair: ServedPair, body: bytes, api_key: str = API_KEY):
    """A streamed POST /v1/completions on a raw socket, returned once the first event has
    arrived: the test closes it when it chooses (a client that hangs up, a budget held)."""
    import socket

    sock = socket.create_connection(("127.0.0.1", pair.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + api_key.encode() + b"\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    received = pair.bodies.add("POST /v1/completions (a stream's start)")
    while b"data:" not in received:
        chunk = sock.recv(4096)
        assert chunk, f"the server closed the stream before any event: {received!r}"
        received += chunk
    return sock


def post_raw(pair: ServedPair, path: str, body: bytes, api_key: str = API_KEY) -> tuple:
    """(status, parsed JSON body) of a POST with an exact body."""
    req = urllib.request.Request(pair.base + path, data=body, method="POST",
                                 headers={"Authorization": f"Bearer {api_key}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(pair.read_body(f"POST {path}", r))
    except urllib.error.HTTPError as e:
        return e.code, json.loads(pair.read_body(f"POST {path}", e))


def get_raw(pair: ServedPair, path: str, api_key: str = API_KEY) -> tuple:
    """(status, parsed JSON body) of a GET."""
    code, body = get_text(pair, path, api_key)
    return code, json.loads(body)


def get_text(pair: ServedPair, path: str, api_key: str = API_KEY) -> tuple:
    """(status, body as text) of a GET: /metrics, the cluster page."""
    req = urllib.request.Request(pair.base + path, headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, pair.read_body(f"GET {path}", r).decode("utf-8")
    except urllib.error.HTTPError as e:
        return e.code, pair.read_body(f"GET {path}", e).decode("utf-8")


def reference(model_dir: Path, prompt_ids: List[int], max_tokens: int, temp: float = 0.0,
              seed: Optional[int] = None, **sampling) -> str:
    """mlx_lm.generate's text for these prompt tokens on the unsplit model."""
    import mlx.core as mx
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = _load(model_dir)
    if seed is not None:
        mx.random.seed(seed)
    return generate(model, tokenizer, prompt=prompt_ids, max_tokens=max_tokens,
                    sampler=make_sampler(temp, **sampling))


_LOADED: dict = {}


def _load(model_dir: Path):
    from mlx_lm import load

    if model_dir not in _LOADED:
        _LOADED[model_dir] = load(str(model_dir))
    return _LOADED[model_dir]


def chat_ids(model_dir: Path, messages: list) -> List[int]:
    _, tokenizer = _load(model_dir)
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def text_ids(model_dir: Path, text: str) -> List[int]:
    _, tokenizer = _load(model_dir)
    return list(tokenizer.encode(text))


def reference_steps(model_dir: Path, prompt_ids: List[int], max_tokens: int, **processors) -> list:
    """mlx-lm's greedy generation with mlx_lm.server's logits processors (make_logits_processors
    with these keyword arguments): [(token, logprobs over the vocabulary)] per generated token."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    model, tokenizer = _load(model_dir)
    steps = []
    for r in stream_generate(model, tokenizer, mx.array(prompt_ids), max_tokens=max_tokens,
                             sampler=make_sampler(0.0),
                             logits_processors=make_logits_processors(**processors)):
        steps.append((r.token, r.logprobs))
    return steps
