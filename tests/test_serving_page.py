"""The page in a real browser: Debian's headless Chromium driven by Playwright (from PyPI, with the system
browser: never `playwright install`).

- the default `tinygpt train` model (character tokenizer, 128-token context, no chat template): Completion streams
  the offline greedy continuation, the Chat tab is unavailable and says why;
- a model with a chat template: Chat streams a reply, and a conversation longer than the context drops its oldest
  turns and says so;
- Inspect: token labels on both heat-map axes, the exact weight on hover, a colour scale, one small heat map per
  head (each with its own labels on both axes and its weights on hover), the next-token table of the clicked
  position, the logit lens as a layer x position grid, an explanation with a guide link beside each view (every
  link a page of the repository) and a link to the guide's tour of the view.

Screenshots of every view are written into ``$TINYGPT_PAGE_SCREENSHOTS`` when set, else into each test's
``tmp_path/screenshots`` (pytest keeps the last three runs under its basetemp).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from serving_support import TEXT, live_server, tiny_model, tokenizer
from tinygpt import GPTConfig, GPTModel, generate_text
from tinygpt.serving.chat_format import render_chat
from tinygpt.tokenizer import CharTokenizer

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WHITE = [255, 255, 255, 255]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian package `chromium`; .ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the test extra's playwright is not installed")
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("profile")), executable_path=str(CHROMIUM), args=ARGS, headless=True,
            viewport={"width": 1280, "height": 900})
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def browser_page(browser):
    page = browser.new_page()
    page.set_default_timeout(30_000)
    try:
        yield page
    finally:
        page.close()


@pytest.fixture
def shots(tmp_path):
    folder = Path(os.environ.get("TINYGPT_PAGE_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _open(page, server, name):
    page.goto(server.url + "/")
    page.wait_for_function(f"window.tinygpt.card !== null && window.tinygpt.card.id === {name!r}")


def char_model():
    """What `tinygpt train` makes by default, in small: a character tokenizer and a 128-token context."""
    chars = CharTokenizer(TEXT)
    model = GPTModel(GPTConfig(vocab_size=chars.vocab_size, context_length=128, emb_dim=32, n_heads=2,
                               n_layers=2)).eval()
    return model, chars


def test_completion_streams_on_a_char_model_and_chat_says_why_it_is_closed(browser_page, shots):
    from tinygpt.serving.app import create_app
    from tinygpt.serving.server import BackgroundServer

    page = browser_page
    model, chars = char_model()
    prompt = "The quick brown fox"
    with BackgroundServer(create_app(model, chars, model_name="chars")) as server:
        _open(page, server, "chars")
        assert page.locator("#view-completion").is_visible()  # no template: the page opens on Completion
        assert page.locator("#tab-chat").get_attribute("data-unavailable") == "true"
        assert "no chat template" in page.locator("#tab-chat").get_attribute("title")
        page.click("#tab-chat")
        reason = page.locator("#chat-unavailable")
        assert reason.is_visible() and "no chat template" in reason.text_content()
        assert page.locator("#send").is_disabled() and page.locator("#chat-input").is_disabled()
        page.screenshot(path=str(shots / "chat-unavailable.png"))
        page.click("#go-completion")

        page.fill("#prompt", prompt)
        page.click("#complete")
        page.wait_for_function("window.tinygpt.completion !== null && window.tinygpt.completion.done")
        streamed = page.evaluate("window.tinygpt.completion")
        fit = 128 - len(prompt) + 1  # max tokens "what fits": the rest of the context
        assert streamed["max_tokens"] == fit
        assert streamed["text"] == generate_text(model, chars, prompt, max_new_tokens=fit)  # greedy, exactly
        assert streamed["deltas"] > 1  # streamed, not one answer
        assert page.locator("#completion .continuation").text_content() == streamed["text"]
        assert page.locator("#completion .error").count() == 0
        page.screenshot(path=str(shots / "completion.png"))
    assert (shots / "completion.png").stat().st_size > 0


def test_chat_streams_with_the_template_and_drops_the_oldest_turns_past_the_context(browser_page, shots):
    page = browser_page
    one = len(tokenizer().encode(render_chat([("user", "Name a colour.")])))
    two = len(tokenizer().encode(render_chat([("user", "Name a colour."), ("assistant", "x" * 6),
                                              ("user", "Another.")])))
    context = one + 8  # one exchange fits, two never do (two > one + 8: the second prompt repeats the preamble)
    assert two > context
    with live_server(tiny_model(context_length=context), max_batch=2) as server:
        _open(page, server, "tiny")
        assert page.locator("#view-chat").is_visible() and page.locator("#chat-unavailable").is_hidden()
        page.fill("#max_tokens", "6")
        page.fill("#chat-input", "Name a colour.")
        page.click("#send")
        page.wait_for_function("window.tinygpt.reply !== null && window.tinygpt.reply.done")
        assert page.locator("#messages .msg.error").count() == 0
        reply = page.locator("#messages .msg.assistant").last.text_content()
        streamed = page.evaluate("window.tinygpt.reply")
        assert reply and streamed["text"] == reply and streamed["deltas"] > 1

        page.fill("#chat-input", "Another.")
        page.click("#send")
        page.wait_for_function("window.tinygpt.reply.done && document.querySelectorAll('#messages .msg').length > 3")
        assert page.locator("#messages .msg.error").count() == 0
        assert page.evaluate("window.tinygpt.dropped") == 2  # the first exchange is no longer sent
        notice = page.locator("#messages .msg.notice")
        assert notice.count() == 1 and f"{context}-token context" in notice.text_content()
        assert page.locator("#messages .msg.dropped").count() == 2
        assert page.locator("#messages .msg.assistant").count() == 2
        page.screenshot(path=str(shots / "chat-context.png"))


def test_inspect_views_label_show_exact_weights_and_grid_the_logit_lens(browser_page, shots):
    page = browser_page
    model = tiny_model(context_length=256)
    with live_server(model, max_batch=2) as server:
        _open(page, server, "tiny")
        page.click("#tab-inspect")
        page.fill("#inspect-input", "The quick brown fox jumps")
        page.select_option("#layer", "1")
        page.click("#inspect-run")
        page.wait_for_function("window.tinygpt.inspect !== null")
        page.select_option("#head", "1")
        data = page.evaluate("window.tinygpt.inspect")
        n, heads, layers = len(data["tokens"]), data["n_heads"], data["n_layers"]
        assert n > 3 and page.locator("#tokens span").count() == n

        # Heat map: a label per key and per query, each the token's text (spaces shown as a visible mark)
        shown = [t["text"].replace(" ", "\u2423").replace("\n", "\u21b5") for t in data["tokens"]]
        assert page.locator("#heat-cols span").all_text_contents() == shown
        assert [r.rsplit(" ", 1)[0] for r in page.locator("#heat-rows span").all_text_contents()] == shown
        assert page.locator("#scale").is_visible() and page.locator("#scale-box .tick").count() == 5
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
        weights = data["attention"][1]
        for i in range(n):
            for j in range(n):
                assert (cells[i][j] == WHITE) == (j > i), (i, j)  # white exactly where the future is masked
                assert (weights[i][j] == 0) == (j > i), (i, j)
        # Hover: the value shown is the returned weight, for cells on, below and above the diagonal
        page.locator("#heatmap").scroll_into_view_if_needed()
        box = page.locator("#heatmap").bounding_box()
        cell = int(page.locator("#heatmap").get_attribute("data-cell"))
        for i, j in [(n - 1, 0), (2, 2), (1, 3)]:
            page.mouse.move(box["x"] + 1 + j * cell + cell / 2, box["y"] + 1 + i * cell + cell / 2)
            page.wait_for_function(f"window.tinygpt.hover && window.tinygpt.hover.i === {i} && "
                                   f"window.tinygpt.hover.j === {j}")
            assert page.evaluate("window.tinygpt.hover.weight") == weights[i][j]
            assert float(page.locator("#heat-value").get_attribute("data-weight")) == weights[i][j]
            assert f"weight {page.locator('#heat-value').get_attribute('data-weight')}" in \
                page.locator("#heat-value").text_content()
        page.locator("#heatmap").screenshot(path=str(shots / "inspect-heatmap.png"))

        # Small multiples: every head of the layer, the chosen one marked, each with its own token labels on both
        # axes and its exact weights on hover; clicking one shows it above
        figures = page.locator("#heads figure")
        assert figures.count() == heads == 2
        assert page.locator("#heads figure.selected").get_attribute("data-head") == "1"
        for h in range(heads):
            figure = figures.nth(h)
            assert figure.locator(".mini-cols span").all_text_contents() == shown
            assert figure.locator(".mini-rows span").all_text_contents() == shown
        figures.nth(0).scroll_into_view_if_needed()
        mini = figures.nth(0).locator("canvas")
        box, small = mini.bounding_box(), int(mini.get_attribute("data-cell"))
        for i, j in [(n - 1, 1), (1, 2)]:
            page.mouse.move(box["x"] + 1 + j * small + small / 2, box["y"] + 1 + i * small + small / 2)
            page.wait_for_function(f"window.tinygpt.headHover && window.tinygpt.headHover.i === {i} && "
                                   f"window.tinygpt.headHover.j === {j}")
            assert page.evaluate("window.tinygpt.headHover.head") == 0
            assert page.evaluate("window.tinygpt.headHover.weight") == data["attention"][0][i][j]
            assert float(page.locator("#heads-value").get_attribute("data-weight")) == data["attention"][0][i][j]
            assert page.locator("#heads-value").text_content().startswith(f"head 0: query {i} ")
        figures.nth(0).click()
        assert page.locator("#head").input_value() == "0" and page.locator("#heatmap").get_attribute("title") \
            == "layer 1, head 0"
        page.locator("#heads").screenshot(path=str(shots / "inspect-heads.png"))

        # The next-token table follows the clicked position
        page.locator("#tokens span").nth(1).click()
        table = page.locator("#next-table")
        assert table.get_attribute("data-position") == "1"
        assert table.locator("tr").count() == 1 + 5  # header + top 5
        first = table.locator("tr").nth(1).locator("td").first.text_content()
        assert first == data["next"][1][0]["token"].replace(" ", "\u2423").replace("\n", "\u21b5")
        page.locator("#next").screenshot(path=str(shots / "inspect-next.png"))

        # Logit lens: one cell per (block, position) with the top token and its probability; the last block's row
        # is the model's own prediction (the next-token table's first row)
        grid = page.locator("#lens td.lens-cell")
        assert grid.count() == layers * n
        for layer in range(layers):
            for i in range(n):
                entry = data["lens"][layer][i]
                td = page.locator(f"#lens td.lens-cell[data-layer='{layer}'][data-position='{i}']")
                assert td.locator("small").text_content() == f"{100 * entry['prob']:.1f}%"
        assert [row[0]["id"] for row in data["next"]] == [c["id"] for c in data["lens"][-1]]
        page.locator("#lens").screenshot(path=str(shots / "inspect-lens.png"))

        # Each view explains itself and links to the guide page that explains it
        links = page.locator("#view-inspect .explain a").evaluate_all("els => els.map(e => e.getAttribute('href'))")
        assert {"docs/guide/05-block.md", "docs/guide/09-generation.md", "docs/guide/06-gptmodel.md",
                "docs/guide/04b-attention.md"} <= set(links)
        tour = page.locator("#guide-tour").get_attribute("href")
        assert tour == "docs/guide/13-your-model.md" and all((ROOT / link).exists() for link in {*links, tour})
        page.screenshot(path=str(shots / "inspect.png"), full_page=True)
    for name in ("inspect-heatmap", "inspect-heads", "inspect-next", "inspect-lens", "inspect"):
        assert (shots / f"{name}.png").stat().st_size > 0


def test_chat_with_a_lora_adapter_served_beside_a_base_without_a_template(browser_page, shots, tmp_path):
    """``serve --model BASE --adapter sft=RUN``: the base has no template, the adapter folder carries the one it was
    fine-tuned in; the page opens on the adapter's Chat, its reply is the merged model's, and picking the base
    closes Chat again. A guide link opens a page of the guide."""
    from lora_support import clone, trained_adapter
    from tinygpt import lora
    from tinygpt.interop.peft import save_adapter
    from tinygpt.serving.app import create_app
    from tinygpt.serving.server import BackgroundServer

    page = browser_page
    base, plain = tiny_model(context_length=96), tokenizer().with_chat_template(None)
    adapted, _ = trained_adapter(base, lora.LoRAConfig(r=4), seed=3, scale=0.5)
    save_adapter(adapted, tmp_path / "run", tokenizer=tokenizer())  # as a LoRA sft run saves it
    with BackgroundServer(create_app(clone(base), plain, model_name="base", adapter=[f"sft={tmp_path / 'run'}"])) \
            as server:
        _open(page, server, "sft")
        assert page.locator("#model-pick").is_visible() and page.locator("#view-chat").is_visible()
        page.fill("#max_tokens", "6")
        page.fill("#chat-input", "Name a colour.")
        page.click("#send")
        page.wait_for_function("window.tinygpt.reply !== null && window.tinygpt.reply.done")
        assert page.locator("#messages .msg.error").count() == 0
        want = generate_text(lora.merged_model(adapted), tokenizer(), render_chat([("user", "Name a colour.")]),
                             max_new_tokens=6, stop_texts=["\n### Instruction:", "\n### Input:", "\n### Response:"])
        assert page.evaluate("window.tinygpt.reply")["text"] == want
        page.screenshot(path=str(shots / "chat-adapter.png"))
        page.select_option("#model-pick", "base")
        assert page.evaluate("window.tinygpt.card.id") == "base"
        assert page.locator("#tab-chat").get_attribute("data-unavailable") == "true"
        link = page.evaluate("document.querySelector('a[href^=\"docs/\"]').href")
        assert page.goto(link).status == 200 and page.locator("body").text_content().lstrip().startswith("#")
