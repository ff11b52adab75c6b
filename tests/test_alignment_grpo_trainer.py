"""The GRPO stage: G seeded completions through the engine together equal each drawn alone (the calculator's forced
tokens included); forced tokens get exactly zero gradient; a stopped and resumed run equals one never stopped; the
command runs from the shipped task's files and refuses a bad reward function in one line."""

from __future__ import annotations

import json

import pytest
import torch

from tinygpt import GPTConfig, GPTModel, save_model
from tinygpt.alignment import FinetuneOptions
from tinygpt.alignment import grpo_trainer
from tinygpt.alignment.arithmetic import make_problems
from tinygpt.alignment.data import format_prompt
from tinygpt.alignment.grpo_trainer import GRPOConfig, GRPOStage, complete
from tinygpt.alignment.verifiers import RewardScorer
from tinygpt.cli import main
from tinygpt.tokenizer import BPETokenizer
from tinygpt.tools import Calculator, tool_output
from tinygpt.training import run_stage

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def task_tokenizer():
    """A 512-token byte-level BPE trained on 200 of the task's worked problems."""
    return BPETokenizer.train([p.prompt + p.output for p in make_problems(200, seed=5)], 512)


def _model(tokenizer, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(GPTConfig(vocab_size=tokenizer.vocab_size, context_length=96, emb_dim=32, n_heads=2,
                              n_layers=1, drop_rate=0.0))


class _CallingCalculator(Calculator):
    """The calculator on a row that may only draw a digit, '+', '<<', '=' or end-of-text: a random model then opens
    and closes calls often, so the tool's forced tokens are there to check."""

    def __init__(self, tokenizer, max_calls: int = 8) -> None:
        super().__init__(tokenizer, max_calls)
        keep = [t for t in range(tokenizer.vocab_size) if t != tokenizer.eot_id
                and tokenizer.decode([t]) in (*"0123456789", "+", "<<", "=")]
        self.mask = torch.zeros(tokenizer.vocab_size, dtype=torch.bool)
        self.mask[keep + [tokenizer.eot_id]] = True

    def allowed(self):
        return self.mask


def _examples(n: int = 12):
    return [{"instruction": p.instruction, "answer": p.answer} for p in make_problems(n, seed=7)]


def test_g_seeded_completions_together_equal_each_alone(task_tokenizer, monkeypatch):
    monkeypatch.setattr(grpo_trainer, "Calculator", _CallingCalculator)
    model = _model(task_tokenizer).eval()
    prompt = task_tokenizer.encode(format_prompt(_examples(1)[0]["instruction"]))
    g, seed = 6, 1234
    together = complete(model, task_tokenizer, [prompt] * g, max_new_tokens=20, temperature=1.0, seed=seed)
    alone = [complete(model, task_tokenizer, [prompt], max_new_tokens=20, temperature=1.0, seed=seed + i)
             for i in range(g)]
    assert together.tokens == [a.tokens[0] for a in alone]
    assert together.forced == [a.forced[0] for a in alone]
    assert len({tuple(t) for t in together.tokens}) > 1  # the G samples differ from one another
    assert sum(map(sum, together.forced)) > 0  # and the tool wrote into some of them
    for text, flags, tokens in zip(together.texts, together.forced, together.tokens):
        for start in [i for i, f in enumerate(flags) if f and (i == 0 or not flags[i - 1])]:
            assert text.count(">>") >= 1 and task_tokenizer.decode(tokens[:start]).endswith("=")


def _stage(tokenizer, seed=0, **config):
    settings = dict(group_size=4, max_new_tokens=12, iterations=2, minibatch_size=6, kl_coef=0.05) | config
    # A reward that varies within every group (the text's length), so the advantages are not all zero.
    scorer = RewardScorer([("length", lambda prompt, completion, example: float(len(completion)))])
    return GRPOStage(_model(tokenizer, seed), tokenizer, _examples(), scorer, config=GRPOConfig(**settings),
                     batch_size=3, val_fraction=0.25, seed=seed)


def test_forced_tool_tokens_get_exactly_zero_gradient(task_tokenizer, monkeypatch):
    monkeypatch.setattr(grpo_trainer, "Calculator", _CallingCalculator)
    stage = _stage(task_tokenizer)
    stage.forward = stage.policy
    updates = stage.batches(0)
    r = stage._rollout
    assert r.forced.any() and not (r.mask & r.forced).any() and r.advantages.abs().sum() > 0
    captured = {}

    def keep_logits(module, inputs, output):
        output.retain_grad()
        captured["logits"] = output

    handle = stage.policy.out_head.register_forward_hook(keep_logits)
    try:
        rows = torch.arange(r.inputs.shape[0])
        loss, _ = stage.loss(rows)
        loss.backward()
    finally:
        handle.remove()
    grad = captured["logits"].grad.abs().sum(dim=-1)  # [N, T]: gradient reaching each action's logits
    assert torch.all(grad[r.forced] == 0)  # forced: nothing, exactly
    assert torch.all(grad[r.mask & (r.advantages[:, None] != 0)] > 0)  # the model's own tokens: something
    assert len(updates) == 2 * 2  # two passes over 12 completions in minibatches of 6


def test_resume_is_bit_exact(tmp_path, task_tokenizer, monkeypatch):
    monkeypatch.setattr(grpo_trainer, "Calculator", _CallingCalculator)
    options = dict(max_steps=4, lr=3e-3, eval_every=100, progress=False)
    straight = _stage(task_tokenizer)
    expected = run_stage(straight, FinetuneOptions(out_dir=str(tmp_path / "a"), **options)).records
    run_stage(_stage(task_tokenizer), FinetuneOptions(out_dir=str(tmp_path / "b"), stop_after=2, **options))
    resumed = _stage(task_tokenizer)
    records = run_stage(resumed, FinetuneOptions(out_dir=str(tmp_path / "b"), resume="auto", **options)).records
    keys = ("reward", "loss", "kl", "grad_norm", "tool_calls")
    assert [[r[k] for k in keys] for r in records] == [[r[k] for k in keys] for r in expected]
    for (name, a), b in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), name
    assert any(r["kl"] > 0 for r in expected)  # the reference term was there to restore


def test_cli_grpo_on_the_shipped_task(tmp_path, task_tokenizer, capsys):
    assert main(["arithmetic-task", "--out", str(tmp_path / "task"), "--train", "40", "--test", "8"]) == 0
    train = [json.loads(line) for line in (tmp_path / "task" / "train.jsonl").read_text().splitlines()]
    assert len(train) == 40 and {"instruction", "output", "answer", "level"} <= set(train[0])
    save_model(_model(task_tokenizer), tmp_path / "base", task_tokenizer)
    common = ["--model", str(tmp_path / "base"), "--data", str(tmp_path / "task" / "train.jsonl"), "--no-progress"]
    code = main(["grpo", *common, "--eval-data", str(tmp_path / "task" / "test.jsonl"), "--out",
                 str(tmp_path / "run"), "--max-steps", "2", "--batch-size", "2", "--group-size", "3",
                 "--max-new-tokens", "6", "--loss-type", "dr_grpo", "--reward-fn", "exact", "--reward-fn", "format"])
    assert code == 0 and "val_accuracy" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and "correct" in records[0]
    assert (tmp_path / "run" / "grpo.png").exists()
    for flags, fragment in [(["--reward-fn", "os:nothing_here"], "has no function 'nothing_here'"),
                            (["--reward-fn", "json:dumps"], "reward function json:dumps raised TypeError on"),
                            (["--group-size", "1"], "--group-size")]:
        code = main(["grpo", *common, "--out", str(tmp_path / "bad"), "--max-steps", "1", "--force", *flags])
        err = capsys.readouterr().err
        assert code == 2 and fragment in err and "Traceback" not in err, err
    with pytest.raises(SystemExit):
        main(["grpo", *common, "--loss-type", "ppo"])
    assert "invalid choice: 'ppo' (choose from 'grpo', 'dapo', 'dr_grpo')" in capsys.readouterr().err


def test_the_calculator_answers_in_chat(task_tokenizer, monkeypatch):
    import re

    from tinygpt.alignment import chat as chat_module
    from tinygpt.alignment.data import ALPACA_CHAT_TEMPLATE

    class NeverEnding(_CallingCalculator):  # end-of-text disallowed: the answer runs its 40 tokens
        def allowed(self):
            return self.mask & (torch.arange(len(self.mask)) != self.tokenizer.eot_id)

    monkeypatch.setattr(chat_module, "Calculator", NeverEnding)
    tokenizer = task_tokenizer.with_chat_template(ALPACA_CHAT_TEMPLATE)
    pieces: list[str] = []
    chat_module.chat(_model(tokenizer).eval(), tokenizer, ["What is 4*12?"], pieces.append, tool=True,
                     max_new_tokens=40, temperature=1.0, seed=3)
    text = "".join(pieces)
    calls = re.findall(r"<<([0-9+<]*)=([^>]*)>>", text)
    assert calls, text  # the tool answered inside the streamed answer, with the calculator's own result
    assert all(result + ">>" == tool_output(expression) for expression, result in calls), calls


@pytest.mark.slow  # an SFT model good enough to have something to reinforce, then three short GRPO runs
def test_grpo_raises_held_out_accuracy_on_the_shipped_task_on_three_seeds(tmp_path):
    import copy

    from tinygpt.alignment.data import InstructionExample
    from tinygpt.alignment.grpo_trainer import accuracy
    from tinygpt.alignment.sft import SFTStage
    from tinygpt.alignment.verifiers import load_reward_fn

    # Half the training solutions answer by heart (mostly wrong for so small a model), half call the calculator.
    train = make_problems(SFT_PROBLEMS, levels=(1,), seed=1, split="train", direct_share=0.5)
    held = [{"instruction": p.instruction, "answer": p.answer}
            for p in make_problems(48, levels=(1,), seed=2, split="test")]
    tokenizer = BPETokenizer.train([p.prompt + p.output for p in train], 512)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=tokenizer.vocab_size, context_length=80, emb_dim=64, n_heads=2,
                               n_layers=RISE_LAYERS, drop_rate=0.0))
    sft = SFTStage(model, tokenizer, [InstructionExample(p.instruction, "", p.output) for p in train], batch_size=16,
                   val_fraction=0.0, seed=0)
    run_stage(sft, FinetuneOptions(out_dir=str(tmp_path / "sft"), max_steps=SFT_STEPS, lr=3e-3, eval_every=10_000,
                                   progress=False))
    before = accuracy(model, tokenizer, held, max_new_tokens=20)
    start = copy.deepcopy(model.state_dict())
    after = []
    for seed in range(3):
        model.load_state_dict(start)
        stage = GRPOStage(model, tokenizer, [{"instruction": p.instruction, "answer": p.answer} for p in train],
                          RewardScorer([load_reward_fn("exact")]), config=GRPOConfig(group_size=8, max_new_tokens=20),
                          eval_examples=held, batch_size=8, seed=seed)
        result = run_stage(stage, FinetuneOptions(out_dir=str(tmp_path / f"grpo{seed}"), max_steps=GRPO_STEPS, lr=5e-4,
                                                  eval_every=10_000, progress=False))
        after.append(result.last_eval["val_accuracy"])
    assert all(a >= before + 4 / 48 for a in after), (before, after)  # each seed: at least 4 more problems right


SFT_PROBLEMS, SFT_STEPS, RISE_LAYERS, GRPO_STEPS = 1000, 800, 2, 30
