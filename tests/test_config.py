import json

import pytest

from tinygpt import PRESETS, GPTConfig, get_config


def test_presets_have_the_seed_sizes():
    expected = {
        "tiny": (16, 16, 16, 4, 2),
        "gpt2-small": (50257, 1024, 768, 12, 12),
        "gpt2-medium": (50257, 1024, 1024, 16, 24),
        "gpt2-large": (50257, 1024, 1280, 20, 36),
        "gpt2-xl": (50257, 1024, 1600, 25, 48),
    }
    for name, sizes in expected.items():
        c = get_config(name)
        assert (c.vocab_size, c.context_length, c.emb_dim, c.n_heads, c.n_layers) == sizes
    assert get_config("tiny").drop_rate == 0.0


def test_overrides_never_change_the_preset():
    before = json.dumps(PRESETS, sort_keys=True)
    c = get_config("gpt2-small", emb_dim=96, n_heads=4, qkv_bias=True)
    assert (c.emb_dim, c.n_heads, c.qkv_bias) == (96, 4, True)
    assert json.dumps(PRESETS, sort_keys=True) == before
    assert get_config("gpt2-small").emb_dim == 768


@pytest.mark.parametrize("bad", [dict(emb_dim=18, n_heads=4), dict(n_layers=0), dict(vocab_size=-3),
                                 dict(context_length=2.5), dict(n_heads=True)])
def test_invalid_sizes_name_the_field(bad):
    field = next(iter(bad)) if "emb_dim" not in bad else "emb_dim"
    with pytest.raises(ValueError, match=field):
        get_config("tiny", **bad)


def test_divisibility_message_names_both_values():
    with pytest.raises(ValueError, match=r"emb_dim=18 must be divisible by n_heads=4"):
        GPTConfig(emb_dim=18, n_heads=4)


@pytest.mark.parametrize("field", ["drop_rate", "drop_rate_emb", "drop_rate_attn", "drop_rate_shortcut"])
@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5])
def test_dropout_rates_must_be_in_unit_interval(field, value):
    with pytest.raises(ValueError, match=rf"{field}={value}.*\[0, 1\)"):
        get_config("tiny", **{field: value})


def test_dropout_rates_fall_back_to_drop_rate():
    c = get_config("tiny", drop_rate=0.3, drop_rate_attn=0.1)
    assert (c.emb_dropout, c.attn_dropout, c.shortcut_dropout) == (0.3, 0.1, 0.3)


def test_unknown_preset_and_override_list_what_is_allowed():
    with pytest.raises(ValueError, match="unknown config 'gpt5'.*gpt2-small"):
        get_config("gpt5")
    with pytest.raises(ValueError, match="unknown override 'n_embd'.*emb_dim"):
        get_config("tiny", n_embd=32)


def test_json_round_trip_is_exact():
    c = get_config("gpt2-medium", drop_rate=0.1, drop_rate_attn=0.05, qkv_bias=True, tie_weights=True, pre_ln=False)
    assert GPTConfig.from_json(c.to_json()) == c
    assert GPTConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_from_dict_rejects_unknown_keys_and_bad_values(tmp_path):
    with pytest.raises(ValueError, match="unknown config key 'n_embd'"):
        GPTConfig.from_dict({"n_embd": 3})
    path = tmp_path / "c.json"
    path.write_text('{"emb_dim": 10, "n_heads": 3}')
    with pytest.raises(ValueError, match="c.json.*emb_dim=10"):
        GPTConfig.from_file(path)
