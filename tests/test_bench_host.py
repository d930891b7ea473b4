"""``sprpo-bench host``: a decode step's time split inside and outside the model's forward, per engine,
on the paper's depth at a narrow width; the split adds up, the engines agree token for token."""
from __future__ import annotations

import json

import pytest

from sprpo_lib.bench import cli as bench_cli
from sprpo_lib.bench.host import HOST_SHAPE, deep_narrow_policy
from sprpo_lib.bench.report import section


def test_the_bench_model_has_the_paper_depth_and_is_seeded():
    a, b = deep_narrow_policy(0), deep_narrow_policy(0)
    assert a.model.config.num_hidden_layers == 28 == HOST_SHAPE.num_hidden_layers
    assert all((p == q).all() for p, q in zip(a.model.parameters(), b.model.parameters()))


def test_host_bench_splits_each_step_and_the_engines_agree(tmp_path):
    out = tmp_path / "host.json"
    argv = ["host", "--engines", "hf,hf-graphs", "--batch", "4", "--new-tokens", "6", "--threads", "1", "--repeats", "1",
            "--out", str(out)]
    assert bench_cli.main(argv) == 0
    rec = json.loads(out.read_text())
    res = rec["results"]
    assert res["layers"] == 28 and res["batch"] == 4
    for name in ("hf", "hf-graphs"):
        r = res["engines"][name]
        assert r["decode_steps"] == 5 and r["greedy_equal"] == "4/4", r  # 6 new tokens: 1 from the prefill, 5 decoded
        assert r["step_ms"] > 0 and r["forward_ms"] > 0
        assert r["forward_ms"] + r["outside_ms"] == pytest.approx(r["step_ms"], abs=0.002) and r["outside_ms"] > 0
    text = section(rec, out)
    assert "| `hf` |" in text and "outside" in text
