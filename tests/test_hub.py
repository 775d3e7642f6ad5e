"""A leader's --model OWNER/NAME not on its machine is downloaded from the Hub (checkpoint/hub.py),
here from a local HTTP server in the Hub's layout (HF_ENDPOINT; nothing beyond 127.0.0.1): the
files arrive in the Hugging Face cache, a worker without --model receives its part from that
leader, HF_HUB_OFFLINE is respected, and a worker never downloads."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pairutil import free_port, reference_text

REPO = "tiny-owner/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ROOT = str(Path(__file__).resolve().parent.parent)


def hub_handler(root: Path, repo: str, served: list):
    files = {p.name: p for p in sorted(root.iterdir()) if p.is_file()}

    class Hub(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _file(self, body: bool) -> None:
            prefix = f"/{repo}/resolve/"
            name = self.path.split("?")[0][len(prefix):].split("/", 1)[-1]
            if not self.path.startswith(prefix) or name not in files:
                self.send_error(404)
                return
            data = files[name].read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.end_headers()
            if body:
                served.append(name)
                self.wfile.write(data)

        def do_HEAD(self):
            self._file(False)

        def do_GET(self):
            if self.path.startswith(f"/api/models/{repo}"):
                if self.path.startswith(f"/api/models/{repo}/tree/"):  # the files, listed
                    info = [{"type": "file", "path": n, "size": p.stat().st_size,
                             "oid": hashlib.sha256(p.read_bytes()).hexdigest()} for n, p in files.items()]
                else:  # the repo, its commit
                    info = {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                            "siblings": [{"rfilename": n} for n in files]}
                data = json.dumps(info).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self._file(True)

    return Hub


@pytest.fixture
def hub(tmp_path):
    """A Hub at HF_ENDPOINT holding a tiny llama as REPO: (its environment, the model, files served)."""
    from mlx_ds4tp.synthetic.tiny_model import save_llama

    model = save_llama(tmp_path / "upload", "tiny", seed=9)
    served: list = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), hub_handler(model, REPO, served))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
           "HF_HUB_CACHE": str(tmp_path / "hub-cache"), "HF_HOME": str(tmp_path / "hf-home"),
           "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("HF_HUB_OFFLINE", None)
    yield env, model, served
    server.shutdown()
    server.server_close()


def resolve(env: dict, download: bool) -> subprocess.CompletedProcess:
    code = ("import sys; from mlx_ds4tp.checkpoint.source import resolve_model; "
            f"print(resolve_model({REPO!r}, download={download}))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_a_leader_downloads_a_repo_it_lacks_once(hub):
    env, model, served = hub
    done = resolve(env, download=True)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])
    assert COMMIT in str(path)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (path / name).read_bytes() == (model / name).read_bytes()
    count = len(served)
    again = resolve(env, download=True)  # in the cache now: nothing fetched
    assert again.returncode == 0 and len(served) == count


def test_a_worker_never_downloads_and_offline_is_respected(hub):
    env, _, served = hub
    worker = resolve(env, download=False)
    assert worker.returncode != 0 and "only a leader downloads" in worker.stderr and not served
    offline = resolve({**env, "HF_HUB_OFFLINE": "1"}, download=True)
    assert offline.returncode != 0 and "the download failed" in offline.stderr and not served


def test_the_pair_downloads_once_on_the_leader_and_the_worker_receives_its_part(hub, procs, tmp_path):
    env, model, served = hub
    text, _ = reference_text(model, "Fetched once", 8)
    port = free_port()
    common = ["-m", "mlx_ds4tp", "run", "--max-tokens", "8", "--no-chat-template", "--transport", "tcp"]
    leader = procs.spawn(common + ["--model", REPO, "--prompt", "Fetched once", "--role", "leader",
                                   "--listen", "127.0.0.1", str(port)], env=env)
    worker = procs.spawn(common + ["--role", "worker", "--coordinator", "127.0.0.1", str(port),
                                   "--parts-dir", str(tmp_path / "parts")], env=env)
    lout, lerr = leader.communicate(timeout=300)
    _, werr = worker.communicate(timeout=60)
    assert leader.returncode == 0, lerr
    assert worker.returncode == 0, werr
    assert lout.rsplit("\n", 2)[0] == text
    assert "downloading it from the Hugging Face Hub" in lerr
    assert served.count("model.safetensors") == 1
