"""The page in a real browser: Debian's headless Chromium driven by Playwright (from PyPI, with the system
browser: never `playwright install`). Chat streams a reply; Inspect draws a heat map whose upper triangle is zero."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving_support import live_server, tiny_model

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WHITE = [255, 255, 255, 255]


@pytest.fixture
def browser_page(tmp_path):
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian package `chromium`; .ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the test extra's playwright is not installed")
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=str(CHROMIUM), args=ARGS, headless=True)
        try:
            page = context.new_page()
            page.set_default_timeout(30_000)
            yield page
        finally:
            context.close()


@pytest.mark.slow
def test_chat_streams_and_inspect_draws_a_causal_heat_map(browser_page, tmp_path):
    page = browser_page
    model = tiny_model(context_length=256)
    with live_server(model, max_batch=2) as server:
        page.goto(server.url + "/")
        page.wait_for_function("document.getElementById('model-name').textContent === 'tiny'")
        # Chat: the reply appears piece by piece; record how its text grows
        page.evaluate("""() => {
            window.seen = [];
            new MutationObserver(() => {
                const last = document.querySelector('#messages .msg.assistant:last-child');
                if (last) window.seen.push(last.textContent);
            }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
        }""")
        page.fill("#max_tokens", "24")
        page.fill("#chat-input", "Name a colour.")
        page.click("#send")
        page.wait_for_function("!document.getElementById('send').disabled && window.seen.length > 0")
        assert page.locator("#messages .msg.error").count() == 0
        reply = page.locator("#messages .msg.assistant").last.text_content()
        grown = [t for t in page.evaluate("window.seen") if t]
        assert reply and len(set(grown)) > 1 and grown[-1] == reply  # streamed: several lengths, then the answer
        page.screenshot(path=str(tmp_path / "chat.png"))

        # Inspect: tokens, the next-token table, and the heat map of layer 1, head 1
        page.click("#tab-inspect")
        page.fill("#inspect-input", "The quick brown fox jumps")
        page.select_option("#layer", "1")
        page.check("#logit-lens")
        page.click("#inspect-run")
        page.wait_for_function("window.tinygpt.inspect !== null")
        page.select_option("#head", "1")
        n = page.evaluate("window.tinygpt.inspect.tokens.length")
        assert n > 3 and page.locator("#tokens span").count() == n
        assert page.locator("#lens table tr").count() == 1 + 2  # header + one row per block
        cells = page.evaluate("""() => {
            const c = document.getElementById('heatmap'), cell = +c.dataset.cell, n = +c.dataset.size;
            const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            const out = [];
            for (let i = 0; i < n; i++) { const row = [];
                for (let j = 0; j < n; j++) {
                    const x = j * cell + (cell >> 1), y = i * cell + (cell >> 1), k = 4 * (y * c.width + x);
                    row.push([data[k], data[k + 1], data[k + 2], data[k + 3]]);
                } out.push(row); }
            return out;
        }""")
        assert len(cells) == n
        for i in range(n):
            for j in range(n):
                if j > i:
                    assert cells[i][j] == WHITE, (i, j)  # the future is masked: weight exactly 0
                else:
                    assert cells[i][j] != WHITE, (i, j)  # every allowed key has some weight
        weights = page.evaluate("window.tinygpt.inspect.attention[1]")
        assert all(weights[i][j] == 0 for i in range(n) for j in range(i + 1, n))
        page.screenshot(path=str(tmp_path / "inspect.png"), full_page=True)
    assert (tmp_path / "inspect.png").stat().st_size > 0
