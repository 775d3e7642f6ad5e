"""The README's loopback recipes, run as a newcomer would run them: each fenced block
marked `<!-- recipe: NAME -->` in README.md is read from the README itself, so a recipe
that stops working (or a README edit that breaks one) fails here.

- demo: `ds4tp demo` (with a short --max-tokens appended) matches the unsplit model;
- serve-loopback + serve-client: the two `ds4tp serve` lines (the worker's, then the
  leader's), on free ports substituted for the README's 9911 and 8080, then the README's
  `openai` client snippet against them; then Ctrl-C on the leader stops both ranks.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pairutil import REPO, free_port

README = Path(REPO) / "README.md"
ARCHITECTURE = Path(REPO) / "docs" / "architecture.md"
RECIPE = re.compile(r"<!-- recipe: ([\w-]+) -->\s*\n```[\w-]*\n(.*?)\n```", re.S)


def recipes() -> dict:
    return {name: body for name, body in RECIPE.findall(README.read_text())}


def recipe(name: str) -> str:
    found = recipes()
    assert name in found, f"README.md has no fenced block marked <!-- recipe: {name} --> ({sorted(found)})"
    return found[name]


def commands(block: str) -> list:
    """The shell lines of a block (comments and blank lines dropped), each as argv, with
    `ds4tp` run as installed (its console script), or as `python -m mlx_ds4tp` without one."""
    ds4tp = [shutil.which("ds4tp")] if shutil.which("ds4tp") else [sys.executable, "-m", "mlx_ds4tp"]
    out = []
    for line in block.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        argv = shlex.split(line)
        assert argv[0] == "ds4tp", f"a recipe line that is not a ds4tp command: {line!r}"
        out.append(ds4tp + argv[1:])
    return out


def child_env() -> dict:
    return dict(os.environ, PYTHONUNBUFFERED="1",
                PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_every_recipe_is_marked():
    assert {"demo", "serve-loopback", "serve-client"} <= set(recipes()), sorted(recipes())


def test_demo_recipe(tmp_path):
    (cmd,) = commands(recipe("demo"))
    res = subprocess.run(cmd + ["--max-tokens", "4"], capture_output=True, text=True, timeout=600,
                         env=child_env(), cwd=tmp_path)
    assert res.returncode == 0, f"{cmd}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    assert "match with the unsplit model in one process: True" in res.stdout, res.stdout + res.stderr


def _health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


class _Ranks:
    """The recipe's two `ds4tp serve` processes, each logging to a file under tmp_path."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.logs = {name: open(tmp_path / f"{name}.log", "w+") for name in ("worker", "leader")}
        self.procs: dict = {}

    def start(self, name: str, cmd: list) -> None:
        self.procs[name] = subprocess.Popen(cmd, env=child_env(), cwd=self.tmp_path, stdout=self.logs[name],
                                            stderr=subprocess.STDOUT, text=True)

    def log(self, name: str) -> str:
        self.logs[name].flush()
        return (self.tmp_path / f"{name}.log").read_text()

    def describe(self) -> str:
        return "\n".join(f"--- {n} (rc {p.poll()}) ---\n{self.log(n)[-4000:]}" for n, p in self.procs.items())

    def wait_healthy(self, port: int, timeout: float) -> None:
        """Until GET /health answers 200; fails naming a rank that exited, or the timeout."""
        deadline = time.monotonic() + timeout
        while _health(port) != 200:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    pytest.fail(f"the {name} exited ({p.returncode}) before the server was up\n{self.describe()}")
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not healthy within {timeout:g} s\n{self.describe()}")
            time.sleep(0.2)

    def wait_all(self, timeout: float, after: str) -> None:
        for name, p in self.procs.items():
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the {name} still runs {timeout:g} s after {after}\n{self.describe()}")

    def close(self) -> None:
        """Kill what still runs (a failed test's ranks), close the logs."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for f in self.logs.values():
            f.close()


def test_serve_recipe(tmp_path):
    pytest.importorskip("openai", reason="the client snippet needs the `openai` package (the test extra)")
    pair_port, http_port = free_port(), free_port()
    block = recipe("serve-loopback")
    assert "9911" in block and "8080" in block, block
    block = re.sub(r"\b9911\b", str(pair_port), block)
    block = re.sub(r"\b8080\b", str(http_port), block)
    worker_cmd, leader_cmd = commands(block)
    assert "worker" in worker_cmd and "leader" in leader_cmd, (worker_cmd, leader_cmd)
    client = re.sub(r"\b8080\b", str(http_port), recipe("serve-client"))
    assert f"127.0.0.1:{http_port}/v1" in client, client

    ranks = _Ranks(tmp_path)
    try:
        # In the README's order: terminal 1 the worker, terminal 2 the leader.
        ranks.start("worker", worker_cmd)
        ranks.start("leader", leader_cmd)
        ranks.wait_healthy(http_port, 300)
        assert "serving demo" in ranks.log("leader"), ranks.describe()

        res = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True,
                             timeout=300, env=child_env(), cwd=tmp_path)
        assert res.returncode == 0, \
            f"the README's client snippet failed:\n{res.stdout}\n{res.stderr}\n{ranks.describe()}"

        # "Ctrl-C on the leader stops both ranks."
        ranks.procs["leader"].send_signal(signal.SIGINT)
        ranks.wait_all(60, "Ctrl-C on the leader")
    finally:
        ranks.close()


def test_the_architecture_has_a_row_for_every_module():
    """Each module of a room (mlx_ds4tp/<room>/<module>.py) has its line in the module map of
    docs/architecture.md, and no line names a module that is gone."""
    package = Path(REPO) / "mlx_ds4tp"
    # cli/__init__.py is the ds4tp command itself, so it has a row; other __init__.py are empty.
    modules = {f"{p.parent.name}/{p.name}" for p in package.glob("*/*.py")
               if p.name != "__init__.py" or p.parent.name == "cli"}
    rows = set(re.findall(r"^([a-z_]+/[a-z_0-9]+\.py) ", ARCHITECTURE.read_text(), re.M))
    rows = {r for r in rows if not r.startswith("examples/")}
    assert modules - rows == set(), f"modules without a row in docs/architecture.md: {sorted(modules - rows)}"
    assert rows - modules == set(), f"docs/architecture.md rows for modules that do not exist: {sorted(rows - modules)}"


def test_ci_runs_the_readmes_test_command():
    """.ci/run ends with the README's test command (the second of its first two), word for word."""
    first = re.search(r"## First two commands\s*\n```sh\n(.*?)\n```", README.read_text(), re.S)
    assert first, "README.md has no fenced sh block under '## First two commands'"
    readme_test = first.group(1).splitlines()[1].split("#")[0].strip()
    ci = (Path(REPO) / ".ci" / "run").read_text().strip().splitlines()
    assert readme_test.startswith("python -m pytest"), readme_test
    assert ci[-1].strip() == readme_test, (ci[-1], readme_test)


def test_the_readme_is_short_and_starts_with_the_two_commands():
    """A newcomer's page: at most 300 lines, its first section the two commands; the rest
    lives in docs/."""
    text = README.read_text()
    lines = len(text.splitlines())
    assert lines <= 300, f"README.md has {lines} lines (at most 300: move detail to docs/)"
    first = re.search(r"^## (.*)$", text, re.M)
    assert first and first.group(1) == "First two commands", first and first.group(1)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_documents_links_resolve():
    """Every relative link of README.md, docs/*.md and tests/README.md names a file that exists,
    and its #anchor a heading of that file."""
    pages = [README, Path(REPO) / "tests" / "README.md", *sorted((Path(REPO) / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not ours to check
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            if not where.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and where.suffix == ".md":
                headings = {_slug(h) for h in re.findall(r"^#+ (.*)$", where.read_text(), re.M)}
                if anchor not in headings:
                    broken.append(f"{page.name}: {target} (no heading #{anchor} in {where.name})")
    assert not broken, "\n".join(broken)
