"""The chat page at ``/``: served as one static file with a strict content security policy,
public even with ``--api-key`` (its requests carry the key typed into it), and driven in a
real browser (Debian's headless Chromium through Playwright) against the real app over a
scripted engine: streaming with a thinking panel, tokens/s, the stop button, the API key."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import httpx
import pytest

from .scripted import ScriptedEngine, ThreadServer, qwen35_tokenizer

SCRIPTS = {"THINK": "weighing it up\n</think>\n\nThe answer is 42.",  # the template opened <think>
           "LONG": " tick" * 400}
KEY = "s3cret-key"
# screenshots of each stage, kept for a person to look at (ignored by git)
ARTEFACTS = Path(__file__).resolve().parents[2] / "test-artefacts" / "chat-page"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = ScriptedEngine(qwen35_tokenizer(tmp_path_factory), SCRIPTS, delay_s=0.002)
    s = ThreadServer(engine, api_key=KEY)
    s.engine = engine
    yield s
    s.stop()


def test_page_is_public_static_and_locked_down(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "'unsafe-inline'" not in csp.split(
        "style-src")[0]
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]{44}'", csp)
    assert r.headers["x-content-type-options"] == "nosniff"
    assert "cdn" not in r.text.lower() and "http://" not in r.text and "https://" not in r.text  # offline
    assert "innerHTML" not in r.text  # model text is shown as text only
    assert httpx.head(server.url + "/").status_code == 200
    # everything else still needs the key
    assert httpx.get(server.url + "/props").status_code == 401
    assert httpx.get(server.url + "/props", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def _browser():
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; .ci/run installs it)")
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install '.[test]' installs it)")
    return exe, sync_playwright, expect


def test_chat_in_a_real_browser(server):
    """The page runs under its own content security policy (no eval: the test waits on
    selectors, which Playwright evaluates outside the page)."""
    exe, sync_playwright, expect = _browser()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "401" not in m.text else None)
        page.goto(server.url + "/")
        page.wait_for_selector("#health.ok")
        expect(page.locator("#props")).to_have_text("enter the API key")

        # without the key: a clear error in the conversation
        page.fill("#input", "SCRIPT=THINK hello")
        page.press("#input", "Enter")
        expect(page.locator(".msg.assistant .error")).to_contain_text("API key")
        ARTEFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=ARTEFACTS / "1-wrong-key.png")

        # with it: the server's props, then a streamed answer with its reasoning apart
        page.fill("#key", KEY)
        page.dispatch_event("#key", "change")
        expect(page.locator("#model")).to_have_text("scripted")
        page.reload()  # the key stays in this tab (session storage)
        expect(page.locator("#key")).to_have_value(KEY)
        expect(page.locator("#model")).to_have_text("scripted")
        page.fill("#system", "Be brief.")
        page.fill("#input", "SCRIPT=THINK what is it?")
        page.click("#send")
        stats = page.locator(".msg.assistant .stats")
        expect(stats).to_have_text(re.compile(r"^\d+ tokens · [\d.]+ tok/s$"))
        expect(page.locator(".msg.assistant .text")).to_have_text("The answer is 42.")
        expect(page.locator(".msg.assistant .reasoning")).to_have_text("weighing it up")
        expect(page.locator(".msg.assistant .reasoning")).to_be_hidden()  # folded once the answer came
        prompt = server.engine.prompts[-1]
        assert "Be brief." in prompt and "what is it?" in prompt  # system prompt and history sent
        page.screenshot(path=ARTEFACTS / "2-answer.png")

        # stop: a long answer (reasoning off: the template opens no think block) is cut and the
        # page takes input again
        page.select_option("#effort", "none")
        page.fill("#input", "SCRIPT=LONG go on")
        page.click("#send")
        second = page.locator(".msg.assistant").nth(1)
        expect(second.locator(".text")).to_have_text(re.compile(r"(tick ){10}"))
        page.click("#stop")
        expect(second.locator(".error")).to_have_text("(stopped)")
        expect(page.locator("#send")).to_be_enabled()
        expect(page.locator("#stop")).to_be_disabled()
        assert len(second.locator(".text").text_content()) < len(SCRIPTS["LONG"])
        page.screenshot(path=ARTEFACTS / "3-stopped.png", full_page=True)
        assert server.engine.prompts[-1].endswith("<think>\n\n</think>\n\n")  # "off" reached the template

        # with a draft: the message's acceptance length next to its speed
        server.engine.spec = {"steps": 4, "proposed": 12, "accepted": 6, "acceptance_length": 2.5}
        page.fill("#input", "SCRIPT=THINK once more")
        page.click("#send")
        expect(page.locator(".msg.assistant .stats").nth(2)).to_have_text(
            re.compile(r"^\d+ tokens · [\d.]+ tok/s · acceptance 2\.50$"))
        server.engine.spec = None
        browser.close()
    assert not errors, errors
