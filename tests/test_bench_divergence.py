"""``sprpo-bench divergence`` on the smoke profile: both phases timed against a positive floor."""
from __future__ import annotations

from sprpo_lib.bench.divergence import bench_divergence


def test_bench_divergence_times_both_phases_against_their_floors(tmp_path, monkeypatch):
    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    res = bench_divergence("smoke", "webshop", states=1, samples=2)
    assert res["states"] == 1 and res["samples"] == 2 and res["setting"] == "rtn 4"
    for phase in ("clean", "setting"):
        assert res[f"{phase}_floor_s_per_state"] > 0 and res[f"{phase}_over_floor"] > 0
    assert res["kl_mean"] >= 0 and res["prompt_tokens_mean"] > 0
