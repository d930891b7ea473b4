"""``sprpo-bench sft``: the SFT step's floor against torch's FLOP counter (the reference), and the
bench on the smoke profile, both paths timed on the same demonstrations."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import adapted_policy
from torch.utils.flop_counter import FlopCounterMode

from sprpo_lib.bench.report import headline
from sprpo_lib.bench.sft import bench_sft, step_flops
from sprpo_lib.model.layers import lowest_trainable_layer
from sprpo_lib.warmstart.sft import collate, response_nll


@pytest.mark.parametrize("layers", [None, 1])
def test_the_sft_floor_is_below_the_counted_flops_and_near_them(layers):
    """One demonstration at a time (no padding), forward and backward of the SFT loss: torch counts
    at least the floor (which leaves out the adapter's weight gradients and part of the lowest LoRA
    layer's backward) and at most 1.4 times it on the tiny model."""
    pol = adapted_policy("tiny-qwen2", layers)
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(3, 250, (n,), generator=g).tolist(), torch.randint(3, 250, (m,), generator=g).tolist())
             for n, m in ((60, 9), (90, 5))]
    counted = 0
    for p, r in pairs:
        with FlopCounterMode(display=False) as fc:
            response_nll(pol.model, collate([(p, r)], 0)).sum().backward()
        counted += fc.get_total_flops()
    floor = step_flops(pol.model.config, pairs, lowest_trainable_layer(pol.model))
    assert floor <= counted <= 1.4 * floor, (counted, floor)


def test_bench_sft_times_the_levers_and_the_reference_on_the_same_demonstrations():
    res = bench_sft("smoke", "webshop", steps=2, warmup=1, repeats=1)
    assert res["demos"] == 3 * res["batch"] and res["floor_s_per_step"] > 0
    for path in ("levers", "reference"):
        assert res[path]["s_per_step"] > 0 and res[path]["over_floor"] > 0 and len(res[path]["walls_s"]) == 1
    assert math.isclose(res["loss"]["levers"], res["loss"]["reference"], rel_tol=1e-2)  # the same steps
    assert res["levers_over_reference"] == pytest.approx(res["levers"]["s_per_step"] / res["reference"]["s_per_step"],
                                                         abs=1e-3)
    line = headline({"bench": "sft", "results": res})  # the record's line on the machine's page
    assert line.startswith("webshop warm-start SFT step") and f"{res['levers_over_reference']}x" in line
