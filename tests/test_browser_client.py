"""The openai JS SDK in headless Chromium, on a page of another origin, streams a chat completion
from `ds4tp serve` (the CORS preflight allows the SDK's own x-stainless-* headers)."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import subprocess
import threading

import pytest

from pairutil import free_port
from serveutil import API_KEY, ServedPair, build_chat_model, chat_ids, reference

PAGE = """<!doctype html><html><body><pre id="out">pending</pre><script type="module">
import OpenAI from "./node_modules/openai/index.mjs";
const out = document.getElementById("out");
try {
  const client = new OpenAI({baseURL: "%(base)s", apiKey: "%(key)s", dangerouslyAllowBrowser: true,
                             maxRetries: 0});
  const stream = await client.chat.completions.create({model: "%(model)s", max_tokens: 8,
      temperature: 0, stream: true, messages: [{role: "user", content: "%(question)s"}]});
  let text = "";
  for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? "";
  out.textContent = "OK:" + JSON.stringify(text);
} catch (e) {
  out.textContent = "ERR:" + e;
}
</script></body></html>"""
QUESTION = "say something"
# Drives the system's Chromium (playwright-core downloads no browser): open the page, wait for
# the answer, print it.
DRIVER = """
const { chromium } = require("playwright-core");
(async () => {
  const browser = await chromium.launch({executablePath: "/usr/bin/chromium", args: ["--no-sandbox"]});
  const page = await browser.newPage();
  const logs = [];
  page.on("console", m => logs.push(m.text()));
  page.on("pageerror", e => logs.push(String(e)));
  await page.goto(process.argv[2]);
  await page.waitForFunction(() => document.getElementById("out").textContent !== "pending",
                             null, {timeout: 60000});
  console.log(JSON.stringify({out: await page.textContent("#out"), logs}));
  await browser.close();
})().catch(e => { console.log(JSON.stringify({out: "ERR:" + e, logs: []})); process.exit(0); });
"""


@pytest.fixture(scope="module")
def sdk(tmp_path_factory):
    """A directory holding node_modules/openai (npm install from the registry)."""
    if shutil.which("chromium") is None:
        pytest.skip("needs Chromium (Debian package chromium)")
    if shutil.which("npm") is None:
        pytest.skip("needs npm (Debian package npm)")
    root = tmp_path_factory.mktemp("js-sdk")
    run = subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "openai@7",
                          "playwright-core@1"], cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return root


def test_the_openai_js_sdk_streams_from_a_page_of_another_origin(sdk, tmp_path):
    model_dir = build_chat_model(tmp_path)
    served = ServedPair(model_dir, tmp_path)
    server = None
    try:
        served.wait_healthy()
        # The page's origin is 127.0.0.1:<page port>; the API is at localhost:<serve port>.
        (sdk / "index.html").write_text(PAGE % {
            "base": f"http://localhost:{served.port}/v1", "key": API_KEY, "model": model_dir.name,
            "question": QUESTION})
        class Static(http.server.SimpleHTTPRequestHandler):
            # A module script is refused unless it comes as JavaScript.
            extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                              ".mjs": "text/javascript", ".js": "text/javascript"}

            def log_message(self, *args):
                pass

        handler = functools.partial(Static, directory=str(sdk))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        page = f"http://127.0.0.1:{server.server_address[1]}/index.html"
        (sdk / "driver.js").write_text(DRIVER)
        run = subprocess.run(["node", "driver.js", page], cwd=sdk, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["out"].startswith("OK:"), result
        want = reference(model_dir, chat_ids(model_dir, [{"role": "user", "content": QUESTION}]), 8)
        assert json.loads(result["out"][3:]) == want
    finally:
        if server is not None:
            server.shutdown()
        served.close()
