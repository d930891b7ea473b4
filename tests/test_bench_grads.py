"""``sprpo-bench grads``: on the smoke batch the profile's passes and the reference give the same
first gradient in float32 (within the gradient tests' 1e-5), the same update twice gives the same
numbers, a bfloat16 model's own rounding is what separates its paths, and the comparisons are the
hand-computed relative L2 and sign agreement."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sprpo_lib.bench.cli import main as bench_main
from sprpo_lib.bench.grads import agreement, bench_grads
from sprpo_lib.bench.report import GRADS_LABELS, headline, section
from sprpo_lib.core.methods import MethodConfig
from sprpo_lib.infra.io import read_json


def test_agreement_by_hand():
    ref = {"grad": torch.tensor([3.0, -4.0, 0.0, 1.0], dtype=torch.float64), "delta": torch.tensor([1.0, 0.0]),
           "mcfg": MethodConfig(name="vanilla")}
    x = {"grad": torch.tensor([3.0, -4.0, 1.0, -1.0], dtype=torch.float64), "delta": torch.tensor([1.0, 1.0]),
         "mcfg": MethodConfig(name="vanilla")}
    got = agreement(x, ref)
    assert got["grad_rel_l2"] == pytest.approx(math.sqrt(1 + 4) / math.sqrt(9 + 16 + 1), rel=2e-3)  # 3 significant digits
    assert got["grad_sign_agree"] == 0.5  # 0 against +1 and -1 against +1 differ
    assert got["delta_rel_l2"] == pytest.approx(1.0)
    assert "S_hat" not in got


def test_float32_paths_agree_and_a_repeat_is_exact(one_thread):
    res = bench_grads("smoke", "webshop", ("vanilla", "sprpo"), ["rollout.tasks_per_step=2"])
    assert res["dtype"] == "float32" and res["samples_nonzero_adv"] > 0
    van, sp = res["methods"]["vanilla"], res["methods"]["sprpo"]
    # one precision: the dtype comparisons are not made
    assert set(van) == {"updates", "levers", "run_to_run"} and set(sp) == {"updates", "levers"}
    for r in (van, sp):
        assert r["levers"]["grad_rel_l2"] < 1e-5 and r["levers"]["grad_sign_agree"] > 0.99
        assert r["levers"]["delta_rel_l2"] < 1e-3
        steps = {u["optimizer_steps"] for u in r["updates"].values()}
        assert len(steps) == 1 and steps.pop() >= 1
    assert van["run_to_run"]["grad_rel_l2"] < 1e-12 and van["run_to_run"]["delta_rel_l2"] < 1e-12
    # at theta_k in float32 the first step's ratios are 1 up to rounding: nothing clipped
    for r in (van, sp):
        for u in r["updates"].values():
            assert u["first_step_clipfrac"] == 0 and u["first_step_ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert sp["levers"]["S_hat"]["S_rel_l2"] < 1e-3 and sp["levers"]["S_hat"]["S_spearman"] > 0.99
    assert set(van["updates"]) == {"shared/model", "shared/model/again", "whole/model"}
    assert sp["updates"]["shared/model"]["extra_pass_s"] > 0  # the S_hat replay ran
    assert res["levers"]["whole"]["prefix_min"] == "0" and res["levers"]["whole"]["attention"] == "sdpa"


def test_bfloat16_rounding_separates_what_float32_does_not(one_thread, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "grads.json"
    assert bench_main(["grads", "--profile", "smoke", "--methods", "vanilla", "--out", str(out),
                       "rollout.tasks_per_step=2", "model.dtype=bfloat16"]) == 0
    rec = read_json(out)
    res = rec["results"]
    assert rec["bench"] == "grads" and res["dtype"] == "bfloat16"
    van = res["methods"]["vanilla"]
    assert set(van) == {"updates"} | set(GRADS_LABELS)
    assert van["levers_float32"]["grad_rel_l2"] < 1e-5
    # bfloat16 moves the reference's own gradient by far more than the levers move it in float32
    assert van["rounding_whole"]["grad_rel_l2"] > 100 * max(van["levers_float32"]["grad_rel_l2"], 1e-9)
    assert van["run_to_run"]["grad_rel_l2"] < 1e-12
    table = section(rec, Path("grads.json"))
    assert "| vanilla | reference: bfloat16 vs float32 |" in table and "| vanilla | whole/float32 |" in table
    assert "in float32" in headline(rec) and "bfloat16 rounding" in headline(rec)


def test_an_unknown_method_is_named_before_any_rollout():
    with pytest.raises(ValueError, match="--methods: expected some of vanilla,sprpo,sprpo_one_pass,sam, got gigpo"):
        bench_grads("smoke", "webshop", ("gigpo",))
