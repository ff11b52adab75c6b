"""``tinygpt serve --tool``: every unconstrained answer may call the calculator, whose results the server forces,
as ``generate --tool`` and ``tinygpt grpo`` do; served greedy equals offline ``generate`` with the same constraint."""

from __future__ import annotations

import re

import httpx
import pytest
import torch

from tinygpt import GPTConfig, GPTModel, generate
from tinygpt.alignment.arithmetic import make_problems
from tinygpt.serving import state as state_module
from tinygpt.serving.app import create_app
from tinygpt.serving.server import BackgroundServer
from tinygpt.tokenizer import BPETokenizer
from tinygpt.tools import Calculator, tool_output

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "What is 4*12? "


class _CallingCalculator(Calculator):
    """The calculator on a row that may only draw a digit, '+', '<<' or '=' (no end-of-text): a random model then
    opens and closes calls often, so the forced results are there to check."""

    def __init__(self, tokenizer, max_calls: int = 8) -> None:
        super().__init__(tokenizer, max_calls)
        keep = [t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) in (*"0123456789", "+", "<<", "=")]
        self.mask = torch.zeros(tokenizer.vocab_size, dtype=torch.bool)
        self.mask[keep] = True

    def allowed(self):
        return self.mask


@pytest.fixture(scope="module")
def tool_server():
    tokenizer = BPETokenizer.train([p.prompt + p.output for p in make_problems(200, seed=5)], 512)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=tokenizer.vocab_size, context_length=96, emb_dim=32, n_heads=2,
                               n_layers=1, drop_rate=0.0)).eval()
    patch = pytest.MonkeyPatch()
    patch.setattr(state_module, "Calculator", _CallingCalculator)
    try:
        with BackgroundServer(create_app(model, tokenizer, model_name="tiny", tool=True, max_batch=4)) as server:
            yield server, model, tokenizer
    finally:
        patch.undo()


def test_served_answers_call_the_calculator_and_equal_offline_generate_with_it_seeded(tool_server):
    server, model, tokenizer = tool_server
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 1.0, "seed": 3}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    calls = re.findall(r"<<([0-9+<]*)=([^>]*)>>", answer)
    assert calls, answer  # the tool answered inside the served text, with the calculator's own results
    assert all(result + ">>" == tool_output(expression) for expression, result in calls), calls
    ids = tokenizer.encode(PROMPT)
    row = generate(model, [ids], max_new_tokens=40, temperature=1.0, seed=3,
                   constraints=[_CallingCalculator(tokenizer)]).rows()[0]
    assert answer == tokenizer.decode(row)


def test_a_request_that_constrains_its_output_runs_without_the_tool(tool_server):
    server, _, _ = tool_server
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "regex": "[a-z]{3,6}"}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert re.fullmatch("[a-z]{3,6}", response.json()["choices"][0]["text"])
