"""Draw the guide's pictures, each in English and in Chinese.

    PYTHONPATH=src python docs/images/make.py [--out docs/images] [--only gelu|attention|attention-steps|residual-anatomy|prepost] [--prepost DIR ...]

- ``gelu_relu.png`` / ``gelu_relu_zh.png``: GELU (tanh, as GPT-2) against ReLU, and their derivatives (guide page 3).
- ``attention_trained.png`` / ``attention_trained_zh.png``: every head's attention weights in both layers of a small
  character model trained here for a few hundred steps on the embedded corpus (guide page 10, exercise 3). CPU,
  one thread: about a minute.
- ``attention_steps.png`` / ``attention_steps_zh.png``: guide page 4b's line through one head of its model (the
  scores, scaled, masked, the softmax) and every head's weights; the model is ``train_char_model`` as the page
  trains it. A few seconds.
- ``residual.png`` / ``residual_zh.png`` and ``anatomy.png`` / ``anatomy_zh.png``: the figures of ``tinygpt experiment
  residual`` and ``tinygpt experiment anatomy`` (guide pages 4 and 7), drawn by the experiments and relabelled in
  Chinese. Seconds.
- ``prepost_*_zh.png``: the figures of ``tinygpt experiment prepost`` with Chinese labels, redrawn from the
  ``prepost.json`` of each ``--prepost DIR`` given (its default run, and a ``--sweep`` run for the sweep figure;
  several ``--sweep`` runs, one per learning rate, make one sweep figure, and then ``prepost_sweep.png`` too).

The Chinese labels need a font with CJK glyphs (Noto Sans CJK, Source Han Sans, WenQuanYi Micro Hei, ...; on Debian
``apt-get install fonts-wqy-microhei``); the script says so and stops if none is installed. The diagrams of the
guide (the block, the route from ids to logits, the KV cache) are Mermaid in the pages themselves, and the pre-LN
figures come from ``tinygpt experiment prepost`` (English labels), redrawn here in Chinese.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from matplotlib import font_manager

from tinygpt import CharTokenizer, GPTConfig, GPTModel
from tinygpt.corpus import embedded_corpus_text
from tinygpt.experiments import prepost_figures
from tinygpt.experiments.attention import attention_weights, train_char_model
from tinygpt.figures import new_figure, save_png
from tinygpt.layers import gelu_tanh_formula

CJK_FONTS = ("Noto Sans CJK SC", "Noto Sans SC", "Source Han Sans SC", "WenQuanYi Micro Hei", "WenQuanYi Zen Hei",
             "SimHei", "Microsoft YaHei", "PingFang SC", "Heiti SC")
TEXT = {
    "en": {"gelu_title": "GELU (tanh approximation, GPT-2) and ReLU", "deriv_title": "their derivatives",
           "x": "x", "y": "f(x)", "dy": "f'(x)", "gelu": "GELU", "relu": "ReLU",
           "min": "GELU's minimum {v:.3f} at x = {x:.2f}",
           "att_title": "layer {layer}, head {head}", "query": "query position (reads)",
           "key": "key position (is read)",
           "att_suptitle": "attention weights of a trained 2-layer character model (each row sums to 1; above the "
                           "diagonal: exactly 0, the causal mask)",
           "weight": "attention weight", "steps_title": ("1. scores Q K^T", "2. scaled: / \u221a{d}",
                                                          "3. masked: the future = \u2212\u221e",
                                                          "4. softmax: weights"),
           "steps_suptitle": "one head (head {head}) of page 4b's trained model, step by step, and all {n} heads",
           "head": "head {head}", "score": "score"},
    "zh": {"gelu_title": "GELU（tanh 近似，GPT-2 所用）与 ReLU", "deriv_title": "二者的导数",
           "x": "x", "y": "f(x)", "dy": "f'(x)", "gelu": "GELU", "relu": "ReLU",
           "min": "GELU 的最小值 {v:.3f}，位于 x = {x:.2f}",
           "att_title": "第 {layer} 层，第 {head} 个头", "query": "query 位置（读取方）",
           "key": "key 位置（被读取方）",
           "att_suptitle": "训练过的两层字符级模型的注意力权重（每行之和为 1；对角线以上恰为 0：因果掩码）",
           "weight": "注意力权重", "steps_title": ("1. 分数 Q K^T", "2. 缩放：/ \u221a{d}",
                                                 "3. 掩码：未来 = \u2212\u221e", "4. softmax：权重"),
           "steps_suptitle": "第 4b 页训练的模型：一个头（第 {head} 个头）逐步计算，以及全部 {n} 个头",
           "head": "第 {head} 个头", "score": "分数"},
}
PROMPT = "def forward(self, x):\n    return self.linear(x)"
# The prepost figures' English texts and their Chinese (applied longest first, so a phrase wins over its words).
PREPOST_ZH = (
    ("measured pre-LN / post-LN", "实测 pre-LN / post-LN"), ("10x (exercise 5's expectation)", "10 倍（练习 5 的预期）"),
    ("1x (equal)", "1 倍（相等）"),
    ("||dL/d input|| pre-LN / post-LN", "||dL/d 输入|| pre-LN / post-LN"),
    ("blocks, same weights: gradient ratio at each block's input", "个块、相同权重：每个块输入处的梯度比值"),
    ("block (1 = next to the embeddings)", "块（1 = 紧挨嵌入层）"),
    ("||dL/dW2|| at init (log scale)", "初始化时的 ||dL/dW2||（对数轴）"),
    ("gradient per block at init,", "初始化时每个块的梯度，"), (" layers", " 层"),
    ("one AdamW step", "一步 AdamW"), ("how far the output moves", "输出移动了多远"),
    ("KL(before || after), nats (log scale)", "KL(更新前 || 更新后)，nat（对数轴）"),
    ("pre-LN + warmup", "pre-LN + warmup"), ("init", "初始化"), ("unigram entropy", "一元熵"),
    ("cross-entropy (nats / char)", "交叉熵（nat / 字符）"), ("step", "步"),
    ("band:", "阴影："), ("seeds' min-max", "个种子的最小–最大"),
    ("mean loss of the last 10% of steps", "最后 10% 步的平均损失"), ("final loss per seed", "每个种子的最终损失"),
    ("cell (depth, init)", "单元（深度，初始化）"), ("||dL/d tok_emb|| (log scale)", "||dL/d tok_emb||（对数轴）"),
    ("token-embedding gradient norm (mean over seeds)", "词元嵌入的梯度范数（种子平均）"),
    ("loss at step 0 (x: diverged)", "第 0 步的损失（x：发散）"), ("learning rate (log scale)", "学习率（对数轴）"),
    ("mean loss, last 10% of steps (nats / char)", "最后 10% 步的平均损失（nat / 字符）"), ("layers", "层数"),
)


# The residual and anatomy figures' English texts and their Chinese.
EXPERIMENT_ZH = (
    ("Residual shortcuts: weight gradients of the 5-layer example", "残差捷径：5 层示例网络的权重梯度"),
    ("(seed ", "（种子 "), ("without shortcuts", "无捷径"), ("with shortcuts", "有捷径"),
    ("layer (input -> output width)", "层（输入 -> 输出宽度）"), ("mean |dL/dW| (log scale)", "|dL/dW| 的平均值（对数轴）"),
    ("layer ", "第 "), ("Where the parameters are (total above each bar; untied head, no QKV bias unless configured)",
                        "参数在哪里（柱顶为总数；输出头不共享，除非配置否则 QKV 无偏置）"),
    ("% of parameters", "参数占比 %"), ("config", "配置"), ("embeddings", "嵌入"), ("attention", "注意力"),
    ("feed-forward", "前馈网络"), ("norms", "归一化"), ("head", "输出头"),
)


def _zh(text: str, table: tuple = PREPOST_ZH) -> str:
    if table is EXPERIMENT_ZH:
        text = text.replace(")", "）") if text.startswith("Residual") else text
    for en, zh in sorted(table, key=lambda pair: -len(pair[0])):
        text = text.replace(en, zh)
    return text


def translated(fig, font: str, table: tuple = PREPOST_ZH):
    """``fig`` with every title, axis label, legend entry and tick label put through ``table``."""
    for ax in fig.axes:
        ax.set_title(_zh(ax.get_title(), table), fontfamily=font)
        ax.set_xlabel(_zh(ax.get_xlabel(), table), fontfamily=font)
        ax.set_ylabel(_zh(ax.get_ylabel(), table), fontfamily=font)
        legend = ax.get_legend()
        for text in legend.get_texts() if legend else ():
            text.set_text(_zh(text.get_text(), table))
            text.set_fontfamily(font)
        labels = ax.get_xticklabels()
        for label in labels:
            text = _zh(label.get_text(), table)
            label.set_text(text.replace("\n", " 层\n", 1) if table is EXPERIMENT_ZH and text.startswith("第 ") else text)
            label.set_fontfamily(font)
        ax.set_xticks(ax.get_xticks(), labels)
    return fig


def experiment_figures(font: str) -> dict:
    """The residual and anatomy experiments' own figures, in English and relabelled in Chinese: {file name: Figure}."""
    import tempfile

    from tinygpt.experiments import anatomy, residual

    figures = {}
    for module, run in ((residual, residual.run_residual), (anatomy, anatomy.run_anatomy)):
        drawn: list[dict] = []
        finish = module.finish

        def keep(*args, finish=finish, drawn=drawn):
            drawn.append(args[6])  # finish(name, directory, title, tables, data, findings, figures)
            return finish(*args)

        module.finish = keep
        try:
            with tempfile.TemporaryDirectory() as tmp:
                run(out=tmp)
                run(out=tmp)  # a second drawing of the same figures, to relabel
        finally:
            module.finish = finish
        for stem, fig in drawn[0].items():
            figures[f"{stem}.png"] = fig
            figures[f"{stem}_zh.png"] = translated(drawn[1][stem], font, EXPERIMENT_ZH)
    return figures


def prepost_figures_zh(directories: list[Path], font: str) -> dict:
    """The Chinese prepost figures from each folder's ``prepost.json``: {file name: Figure}."""
    figures = {}
    for directory in directories:
        data = json.loads((directory / "prepost.json").read_text(encoding="utf-8"))
        plateau = data["unigram_entropy"]
        figures["prepost_gradients_zh.png"] = prepost_figures.gradient_figure(data["stacks"]["results"])
        if "init_profile" in data and len(data["init_profile"]["grad_norm_per_block"]["gpt2"]) > 1:
            profile = data["init_profile"]["grad_norm_per_block"]
            figures["prepost_profile_zh.png"] = prepost_figures.profile_figure(profile)
            figures["prepost_mechanism_zh.png"] = prepost_figures.mechanism_figure(
                profile, data["one_step_change"]["kl"], data["one_step_change"]["lr"])
        if "training" in data:
            t = data["training"]
            figures["prepost_training_zh.png"] = prepost_figures.training_figure(t["cells"], plateau, t["lr"],
                                                                                 t["warmup"])
    cells, plateau = sweep_cells(directories)
    if cells:
        figures["prepost_sweep_zh.png"] = prepost_figures.sweep_figure(cells, plateau)
    return {name: translated(fig, font) for name, fig in figures.items()}


def sweep_cells(directories: list[Path]) -> tuple[list[dict], float]:
    """Every sweep cell of the folders' ``prepost.json`` files, by depth and learning rate (one ``--sweep`` run per
    learning rate can run in parallel and be drawn as one figure), and the unigram entropy."""
    cells, plateau = [], float("nan")
    for directory in directories:
        data = json.loads((directory / "prepost.json").read_text(encoding="utf-8"))
        if "sweep" in data:
            cells += data["sweep"]["cells"]
            plateau = data["unigram_entropy"]
    return sorted(cells, key=lambda c: (c["depth"], c["lr"])), plateau


def cjk_font() -> str:
    for attempt in range(2):
        available = {f.name for f in font_manager.fontManager.ttflist}
        for name in CJK_FONTS:
            if name in available:
                return name
        # matplotlib's font cache predates a font installed since: add the system's CJK font files by name.
        for path in font_manager.findSystemFonts():
            if any(k in Path(path).name.lower() for k in ("cjk", "wqy", "sourcehan", "simhei", "msyh", "pingfang")):
                font_manager.fontManager.addfont(path)
    sys.exit("make.py: error: no font with Chinese glyphs is installed (tried: " + ", ".join(CJK_FONTS)
             + "); install one, e.g. `apt-get install fonts-wqy-microhei`, then run again")


def _font(lang: str, font: str | None) -> dict:
    return {"fontfamily": font} if lang == "zh" and font else {}


def gelu_figure(lang: str, font: str | None):
    t = TEXT[lang]
    kw = _font(lang, font)
    x = torch.linspace(-4, 4, 801, dtype=torch.float64, requires_grad=True)
    fig = new_figure(11, 4)
    ax_f, ax_d = fig.subplots(1, 2)
    for name, fn, style in (("gelu", gelu_tanh_formula, "-"), ("relu", F.relu, "--")):
        y = fn(x)
        (dy,) = torch.autograd.grad(y.sum(), x)
        ax_f.plot(x.detach(), y.detach(), style, label=t[name])
        ax_d.plot(x.detach(), dy, style, label=t[name])
    y = gelu_tanh_formula(x).detach()
    i = int(y.argmin())
    ax_f.plot([x[i].item()], [y[i].item()], "o", color="black", ms=4)
    ax_f.annotate(t["min"].format(v=y[i].item(), x=x[i].item()), (x[i].item(), y[i].item()),
                  xytext=(-3.9, 1.2), arrowprops={"arrowstyle": "->"}, **kw)
    for ax, title, ylabel in ((ax_f, t["gelu_title"], t["y"]), (ax_d, t["deriv_title"], t["dy"])):
        ax.axhline(0, color="gray", lw=0.5)
        ax.axvline(0, color="gray", lw=0.5)
        ax.set_title(title, **kw)
        ax.set_xlabel(t["x"], **kw)
        ax.set_ylabel(ylabel, **kw)
        ax.grid(alpha=0.3)
        ax.legend()
    return fig


def trained_model(steps: int = 600, seed: int = 123) -> tuple[GPTModel, CharTokenizer]:
    """A 2-layer character model (C=64, D=64, H=4) trained ``steps`` AdamW steps on the embedded corpus."""
    text = embedded_corpus_text(max_chars=300_000)
    tokenizer = CharTokenizer(text)
    ids = torch.tensor(tokenizer.encode(text))
    config = GPTConfig(vocab_size=tokenizer.vocab_size, context_length=64, emb_dim=64, n_heads=4, n_layers=2)
    torch.manual_seed(seed)
    model = GPTModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        starts = torch.randint(0, len(ids) - 65, (32,), generator=generator)
        window = ids[starts[:, None] + torch.arange(65)]  # [B, 65]
        loss = F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"  attention model step {step:4d} loss {loss.item():.3f}", file=sys.stderr)
    return model.eval(), tokenizer


def attention_figure(model: GPTModel, tokenizer: CharTokenizer, lang: str, font: str | None):
    t = TEXT[lang]
    kw = _font(lang, font)
    idx = torch.tensor([tokenizer.encode(PROMPT)])
    chars = [repr(c)[1:-1] if c in "\n\t" else (c if c != " " else "␣") for c in PROMPT]
    n_layers, n_heads = len(model.trf_blocks), model.config.n_heads
    fig = new_figure(4.2 * n_heads + 1.0, 4.4 * n_layers + 0.6, layout="constrained")
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    image = None
    with torch.no_grad():
        for layer in range(n_layers):
            weights, _ = attention_weights(model, idx, layer)  # [1, H, T, T]
            for head in range(n_heads):
                ax = axes[layer][head]
                image = ax.imshow(weights[0, head].numpy(), cmap="viridis", vmin=0, vmax=1)
                ax.set_xticks(range(len(chars)), chars, fontsize=7, fontfamily="monospace")
                ax.set_yticks(range(len(chars)), chars, fontsize=7, fontfamily="monospace")
                ax.set_title(t["att_title"].format(layer=layer, head=head), fontsize=9, **kw)
                ax.set_xlabel(t["key"], fontsize=8, **kw)
                ax.set_ylabel(t["query"], fontsize=8, **kw)
    fig.suptitle(t["att_suptitle"], fontsize=10, **kw)
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6)
    bar.set_label(t["weight"], **kw)
    return fig


STEPS_LINE, STEPS_HEAD = "self.x = x", 3  # guide page 4b's line and head


def attention_steps_figure(lang: str, font: str | None):
    """Page 4b's model and line: one head's scores, scaled, masked and softmaxed, then every head's weights."""
    t = TEXT[lang]
    kw = _font(lang, font)
    model, tokenizer, _ = train_char_model(embedded_corpus_text(max_chars=200_000), steps=600, seed=0)
    idx = torch.tensor([tokenizer.encode(STEPS_LINE)])  # [1, T]
    chars = [c if c != " " else "\u2423" for c in STEPS_LINE]
    n, d, block = len(chars), model.config.head_dim, model.trf_blocks[0]
    with torch.no_grad():
        x, _ = model.embed(idx)
        q, k, _ = block.att.qkv(block.norm1(x)).split(model.config.emb_dim, dim=-1)  # [1, T, D] each
        cols = slice(STEPS_HEAD * d, (STEPS_HEAD + 1) * d)
        scores = q[0, :, cols] @ k[0, :, cols].T  # [T, T]
        future = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        scaled = scores / d ** 0.5
        masked = scaled.masked_fill(future, float("-inf"))
        weights, _ = attention_weights(model, idx, 0)  # [1, H, T, T]
    heads = model.config.n_heads
    fig = new_figure(3.3 * max(4, heads) + 1.2, 7.4, layout="constrained")
    axes = fig.subplots(2, max(4, heads), squeeze=False)
    score_max = scores.abs().max().item()
    for ax, title, m in zip(axes[0], t["steps_title"], (scores, scaled, masked, weights[0, STEPS_HEAD])):
        probs = title is t["steps_title"][3]
        shown = m.masked_fill(future, float("nan")) if not probs and m is masked else m
        image = ax.imshow(shown.numpy(), cmap="viridis" if probs else "coolwarm", vmin=0 if probs else -score_max,
                          vmax=1 if probs else score_max)
        ax.set_title(title.format(d=d), fontsize=9, **kw)
        fig.colorbar(image, ax=ax, shrink=0.7).set_label(t["weight"] if probs else t["score"], **kw)
    for h, ax in enumerate(axes[1]):
        if h >= heads:
            ax.axis("off")
            continue
        image = ax.imshow(weights[0, h].numpy(), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(t["head"].format(head=h), fontsize=9, **kw)
    fig.colorbar(image, ax=axes[1].tolist(), shrink=0.7).set_label(t["weight"], **kw)
    for ax in axes.ravel():
        if ax.axison:
            ax.set_xticks(range(n), chars, fontsize=8, fontfamily="monospace")
            ax.set_yticks(range(n), chars, fontsize=8, fontfamily="monospace")
            ax.set_xlabel(t["key"], fontsize=8, **kw)
            ax.set_ylabel(t["query"], fontsize=8, **kw)
    fig.suptitle(t["steps_suptitle"].format(head=STEPS_HEAD, n=heads), fontsize=10, **kw)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent), help="folder (default: docs/images)")
    parser.add_argument("--only", choices=("gelu", "attention", "attention-steps", "residual-anatomy", "prepost"),
                        help="draw one picture (both languages)")
    parser.add_argument("--prepost", action="append", default=[], metavar="DIR",
                        help="an output folder of `tinygpt experiment prepost` to redraw in Chinese (repeatable)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    font = cjk_font()
    written = []
    if args.only in (None, "gelu"):
        for lang in ("en", "zh"):
            written.append(save_png(gelu_figure(lang, font), out / f"gelu_relu{'' if lang == 'en' else '_zh'}.png"))
    if args.only in (None, "attention"):
        model, tokenizer = trained_model()
        for lang in ("en", "zh"):
            fig = attention_figure(model, tokenizer, lang, font)
            written.append(save_png(fig, out / f"attention_trained{'' if lang == 'en' else '_zh'}.png"))
    if args.only in (None, "attention-steps"):
        for lang in ("en", "zh"):
            fig = attention_steps_figure(lang, font)
            written.append(save_png(fig, out / f"attention_steps{'' if lang == 'en' else '_zh'}.png"))
    if args.only in (None, "residual-anatomy"):
        for name, fig in experiment_figures(font).items():
            written.append(save_png(fig, out / name))
    if args.only in (None, "prepost"):
        folders = [Path(d) for d in args.prepost]
        for name, fig in prepost_figures_zh(folders, font).items():
            written.append(save_png(fig, out / name))
        if sum("sweep" in json.loads((d / "prepost.json").read_text(encoding="utf-8")) for d in folders) > 1:
            cells, plateau = sweep_cells(folders)  # sweeps run apart: the English figure of them all, too
            written.append(save_png(prepost_figures.sweep_figure(cells, plateau), out / "prepost_sweep.png"))
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
