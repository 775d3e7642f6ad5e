"""The cluster page (GET / of `ds4tp serve`) in headless Chromium over a group of three ranks on
127.0.0.1: every rank and every link is shown, a message typed into the chat box gets a
streamed answer (with the API key typed into the page), the page fits a phone's width in dark
mode, and a killed worker turns to down. Screenshots are kept as test artifacts (their paths
printed); DS4TP_DOCS_SCREENSHOT=1 also writes docs/cluster-page.png, the README's."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from pairutil import REPO
from serveutil import API_KEY, ServedPair, build_chat_model

# Drives the system's Chromium (playwright-core downloads no browser). Talks with the test over
# stdin/stdout, one JSON line each way: what the page shows, then, told which rank was killed,
# how long the page took to show it down.
DRIVER = r"""
const { chromium } = require("playwright-core");
const readline = require("readline");
const lines = readline.createInterface({input: process.stdin});
const nextLine = () => new Promise((resolve) => lines.once("line", resolve));
const say = (what) => console.log(JSON.stringify(what));
(async () => {
  const [url, key, shot, phoneShot] = process.argv.slice(2);
  const browser = await chromium.launch({executablePath: "/usr/bin/chromium",
                                         args: ["--no-sandbox", "--disable-background-networking"]});
  const logs = [], outside = [];
  const context = await browser.newContext({viewport: {width: 1280, height: 1000}, colorScheme: "light"});
  const page = await context.newPage();
  page.on("console", m => logs.push(m.text()));
  page.on("pageerror", e => logs.push(String(e)));
  page.on("request", r => { if (!r.url().startsWith(url)) outside.push(r.url()); });
  await page.goto(url);
  await page.fill("#api-key", key);  // kept in localStorage; the next poll sends it
  await page.waitForFunction(() => document.querySelectorAll('[data-rank][data-state="up"]').length === 3 &&
      document.querySelectorAll("tr[data-link]").length === 3 &&
      [...document.querySelectorAll("[data-rank]")].every(r => !r.textContent.includes("memory ?")),
      null, {timeout: 90000});
  const ranks = await page.$$eval("[data-rank]", els => els.map(e => ({rank: e.dataset.rank,
      state: e.dataset.state, text: e.textContent})));
  // The chat: count the answer's updates (a streamed answer grows in several).
  await page.fill("#chat-input", "hello cluster");
  await page.click("#chat-send");
  await page.waitForSelector(".msg.answer", {timeout: 30000});
  await page.evaluate(() => {
    window.answerUpdates = 0;
    const answer = document.querySelector(".msg.answer");
    new MutationObserver(() => window.answerUpdates++).observe(answer,
        {childList: true, characterData: true, subtree: true});
  });
  await page.waitForSelector(".msg.answer[data-done]", {timeout: 120000});
  const chat = await page.$eval(".msg.answer", e => ({done: e.dataset.done, text: e.textContent}));
  const updates = await page.evaluate(() => window.answerUpdates);
  // The answer's gates crossed every link: each shows its latency (a link before its first gate
  // shows "–"; the workers' own link comes with their figures, asked while the engine is idle).
  await page.waitForFunction(() => [...document.querySelectorAll("tr[data-link]")].every(
      r => r.textContent.includes("µs")), null, {timeout: 60000});
  const links = await page.$$eval("tr[data-link]", els => els.map(e => ({link: e.dataset.link,
      state: e.dataset.state, text: e.textContent})));
  await page.screenshot({path: shot, fullPage: true});  // the figures of the answer's last second
  // A phone's width in dark mode: nothing wider than the screen.
  const phone = await browser.newContext({viewport: {width: 390, height: 844}, colorScheme: "dark",
                                          isMobile: true});
  const small = await phone.newPage();
  await small.goto(url);
  await small.fill("#api-key", key);
  await small.waitForFunction(() => document.querySelectorAll("[data-rank]").length === 3, null, {timeout: 30000});
  const phoneWidth = await small.evaluate(() => document.documentElement.scrollWidth);
  const dark = await small.evaluate(() => getComputedStyle(document.body).backgroundColor);
  await small.screenshot({path: phoneShot, fullPage: true});
  await phone.close();
  say({ranks, links, chat, updates, phoneWidth, dark, logs, outside});
  const victim = (await nextLine()).trim();
  const t0 = Date.now();
  await page.waitForSelector(`[data-rank="${victim}"][data-state="down"]`, {timeout: 30000});
  say({downAfterMs: Date.now() - t0, banner: await page.textContent("#banner")});
  await browser.close();
  process.exit(0);  // stdin's reader would keep node waiting
})().catch(e => { say({error: String(e)}); process.exit(1); });
"""


@pytest.fixture(scope="module")
def playwright(tmp_path_factory):
    """A directory holding node_modules/playwright-core (npm install from the registry)."""
    if shutil.which("chromium") is None:
        pytest.skip("needs Chromium (Debian package chromium)")
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("needs node and npm (Debian packages nodejs, npm) for playwright-core")
    root = tmp_path_factory.mktemp("playwright")
    run = subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "playwright-core@1"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return root


def _said(driver: subprocess.Popen, what: str) -> dict:
    line = driver.stdout.readline()
    assert line, f"the browser driver ended before {what}: {driver.stderr.read()[-3000:]}"
    said = json.loads(line)
    assert "error" not in said, said
    return said


def test_the_cluster_page_shows_the_group_streams_a_chat_and_a_killed_worker_down(playwright, tmp_path):
    model_dir = build_chat_model(tmp_path, preset="tiny8")
    served = ServedPair(model_dir, tmp_path, ranks=3, env={"DS4_TP_TIMEOUT_SEC": "8"})
    driver = None
    shot, phone_shot = tmp_path / "cluster-page.png", tmp_path / "cluster-page-phone-dark.png"
    try:
        served.wait_healthy(within=180)
        (playwright / "driver.js").write_text(DRIVER)
        driver = subprocess.Popen(["node", "driver.js", served.base + "/", API_KEY, str(shot), str(phone_shot)],
                                  cwd=playwright, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        shown = _said(driver, "the page showed the group")
        assert not shown["outside"], f"the page asked for URLs outside the server: {shown['outside']}"
        assert [r["rank"] for r in shown["ranks"]] == ["0", "1", "2"], shown
        for rank in shown["ranks"]:
            assert rank["state"] == "up" and "memory" in rank["text"] and "share" in rank["text"], rank
            assert re.search(r"memory [\d.]+ [KMG]?B of [\d.]+ [KMG]?B", rank["text"]), rank
        assert sorted(link["link"] for link in shown["links"]) == ["0-1", "0-2", "1-2"], shown
        for link in shown["links"]:
            assert "tcp" in link["text"] and "µs" in link["text"], link
        assert shown["chat"]["done"] == "1" and shown["chat"]["text"], shown["chat"]
        assert shown["updates"] >= 2, f"the answer came in {shown['updates']} piece(s), not streamed"
        assert shown["phoneWidth"] <= 390, f"the page is {shown['phoneWidth']} px wide on a 390 px phone"
        assert shown["dark"] != "rgb(246, 247, 249)", "dark mode kept the light background"
        found = re.search(r"rank (\d+)/3 holds its part", served.log("worker2"))
        assert found, served.log("worker2")[-2000:]
        served.kill("worker2")
        t0 = time.monotonic()
        driver.stdin.write(found.group(1) + "\n")
        driver.stdin.flush()
        down = _said(driver, "the killed worker shown down")
        print(f"\nthe page showed rank {found.group(1)} down {time.monotonic() - t0:.2f} s after its kill "
              f"({down['downAfterMs']} ms in the page); screenshots: {shot} {phone_shot}")
        assert "down" in down["banner"], down
        assert driver.wait(60) == 0, driver.stderr.read()[-2000:]
        assert shot.stat().st_size > 10_000 and phone_shot.stat().st_size > 10_000
        if os.environ.get("DS4TP_DOCS_SCREENSHOT") == "1":
            shutil.copyfile(shot, Path(REPO) / "docs" / "cluster-page.png")
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait(10)
        served.close()
