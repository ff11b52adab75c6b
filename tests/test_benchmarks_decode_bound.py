"""benchmarks/decode_bound.py runs (quick shape): every route of every weight type is timed over the step's own
weights, the bytes are the stored ones, and bad arguments are refused with what is allowed. No timing asserted."""

import json
import shutil

import pytest

from benchmarks import decode_bound
from benchmarks.weights import QUICK
from tinygpt.fast import row_kernels


def test_step_shapes_are_a_gpt2_steps_products():
    config = QUICK["quick"]
    shapes = decode_bound.step_shapes(config)
    assert len(shapes) == 4 * config.n_layers + 1 and shapes[-1] == (config.vocab_size, config.emb_dim)


@pytest.mark.slow
def test_quick_run_times_each_route_of_each_type(tmp_path, capsys):
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("the compiled route needs inductor's C++ compiler (g++ or c++ on PATH)")
    path = tmp_path / "bound.json"
    assert decode_bound.main(["--quick", "--llama-tok-s", "f32=100,int8=200", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    routes = ("read", "library", "compiled", "read, huge pages", "compiled, huge pages")
    kernels = ("kernels, huge pages",) if row_kernels.load() else ()
    assert [(r["weights"], r["route"]) for r in rows] == [(t, r) for t in ("f32", "bf16", "int8")
                                                          for r in routes + (kernels if t != "f32" else ())]
    params = sum(o * i for o, i in decode_bound.step_shapes(QUICK["quick"]))
    assert {r["weights"]: round(r["mb"] * 1e6) for r in rows} == {"f32": 4 * params, "bf16": 2 * params,
                                                                  "int8": params}
    assert all(r["gb_s"] > 0 for r in rows) and "ceiling_share" in rows[0] and "ceiling_share" not in rows[5]
    assert "ceiling / llama.cpp" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [(["--types", "fp8"], "allowed f32, bf16, int8"),
                                           (["--llama-tok-s", "q4=9"], "TYPE=tok/s"),
                                           (["--llama-tok-s", "f32=fast"], "TYPE=tok/s")])
def test_bad_arguments_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        decode_bound.main(["--quick", *args])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
