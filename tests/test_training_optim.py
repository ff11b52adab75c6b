import math

import pytest
import torch

from tinygpt import GPTModel, get_config
from tinygpt.training import build_optimizer, lr_at


def test_weight_decay_on_matrices_only():
    model = GPTModel(get_config("tiny", tie_weights=True, qkv_bias=True))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))  # the tied weight once
    assert any(p is model.out_head.weight for p in decay["params"])


def test_bad_optimizer_settings():
    model = GPTModel(get_config("tiny"))
    with pytest.raises(ValueError, match="lr"):
        build_optimizer(model, lr=0.0)
    with pytest.raises(ValueError, match="weight_decay"):
        build_optimizer(model, lr=1e-3, weight_decay=-1)


def test_warmup_then_cosine():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert [lr_at(s, **kw) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3], abs=1e-15)
    assert lr_at(9, **kw) == 1.0  # warmup ends at the peak
    assert lr_at(10, **kw) == 1.0  # cosine starts at the peak
    assert math.isclose(lr_at(60, **kw), 0.55)  # halfway down: min + (max - min) / 2
    assert lr_at(110, **kw) == 0.1 and lr_at(500, **kw) == 0.1
    values = [lr_at(s, **kw) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_no_warmup():
    assert lr_at(0, lr=2.0, min_lr=0.0, warmup_steps=0, max_steps=10) == 2.0
