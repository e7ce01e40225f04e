"""The admin dashboard and chat page in a real headless Chromium (Debian's `chromium`, driven by
Playwright): the dashboard shows real numbers after a request, its Restart button restarts the
worker (new pid, back to ready), and the chat page streams an answer. A screenshot of the
dashboard is saved as a test artifact ($STRATA_TEST_ARTIFACTS, else the test's tmp dir)."""
import os
import pathlib
import shutil
import time

import openai
import pytest
from playwright.sync_api import expect, sync_playwright

from test_api import MODEL, running_cluster

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, tmp_path_factory):
    with running_cluster(bin_dir, default_model, tmp_path_factory.mktemp("dashboard")) as c:
        yield c


@pytest.fixture
def page():
    assert pathlib.Path(CHROMIUM).exists(), "chromium missing: run scripts/setup"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        yield page
        browser.close()


def test_dashboard_shows_live_numbers_and_restarts_a_worker(cluster, page, tmp_path):
    token = (cluster.run_dir / "admin-token").read_text().strip()
    page.goto(cluster.url + f"/admin#token={token}")
    row = page.locator(f'tr[data-name="worker-{MODEL}"]')
    expect(row.locator(".state")).to_have_text("ready", timeout=30_000)
    expect(row.locator(".requests")).to_have_text("0")
    expect(page.locator("#cache")).to_contain_text("RAM tier")

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    for _ in range(2):
        client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": "Say hello."}])
    # Live updates: the numbers arrive without reloading the page.
    expect(row.locator(".requests")).to_have_text("2", timeout=15_000)
    expect(row.locator(".ttft")).to_contain_text(" s")
    expect(page.locator("#ttft-plot circle").first).to_be_attached()
    expect(row).to_contain_text("prefix_cache: on")
    expect(row).to_contain_text("store_decode_kv: on")

    artifacts = pathlib.Path(os.environ.get("STRATA_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    print(f"dashboard screenshot: {shot}")

    # Restart from the page: the worker goes away and comes back with a new pid.
    pid = row.locator(".pid").inner_text()
    row.locator("button[data-restart]").click()
    seen = set()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        state, now_pid = row.locator(".state").inner_text(), row.locator(".pid").inner_text()
        seen.add(state)
        if now_pid not in (pid, "–") and state == "ready":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the worker did not come back; states seen: {seen}\n{cluster.log()[-3000:]}")
    print(f"states seen after Restart: {sorted(seen)}")
    assert cluster.worker()["pid"] == int(row.locator(".pid").inner_text())


def test_the_chat_page_streams_an_answer(cluster, page):
    page.goto(cluster.url + "/admin/chat")
    expect(page.locator("#model option")).to_have_text(MODEL)
    page.fill("#input", "What is the capital of France?")
    page.click("#send")
    answer = page.locator(".msg.assistant").first
    expect(answer).not_to_have_text("", timeout=60_000)
    expect(answer.locator(".meta")).to_contain_text("prompt tokens", timeout=60_000)
    assert page.locator("#error").inner_text() == ""


XSS_NAME = '<img src=x onerror="window.__xss=1">'


def test_model_names_are_shown_as_text_not_markup(bin_dir, default_model, tmp_path, page):
    # A model name is the config author's, but it reaches the page: an alias holding markup
    # once ran as script in /admin/chat.
    with running_cluster(bin_dir, default_model, tmp_path, "--alias", XSS_NAME) as c:
        page.goto(c.url + "/admin/chat")
        expect(page.locator("#model option")).to_have_text([MODEL, XSS_NAME])
        assert page.locator("#model img").count() == 0
        assert page.evaluate("window.__xss") is None
        page.goto(c.url + "/admin")
        page.wait_for_timeout(1500)
        assert page.evaluate("window.__xss") is None
