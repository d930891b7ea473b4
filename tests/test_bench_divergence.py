"""``sprpo-bench divergence`` on the smoke profile: both phases timed against a positive floor."""
from __future__ import annotations

from sprpo_lib.bench.divergence import bench_divergence


def test_bench_divergence_times_both_phases_against_their_floors(tmp_path, monkeypatch):
    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    res = bench_divergence("smoke", "webshop", states=2, samples=2, batches_of=(1, 2))
    assert res["states"] == 2 and res["samples"] == 2 and res["setting"] == "rtn 4" and res["batch"] == 2
    assert [r["batch"] for r in res["by_batch"]] == [1, 2]
    one, two = res["by_batch"]
    assert one["clean_floor_s_per_state"] >= two["clean_floor_s_per_state"]  # a batch shares its decode steps' weights
    assert abs(one["kl_mean"] - two["kl_mean"]) < 1e-3 * (1 + one["kl_mean"])  # the same states, the same KLs
    assert one["flip_rate"] == two["flip_rate"] and one["flip_rate"] * 2 in (0, 1, 2)  # a share of the 2 states
    for phase in ("clean", "setting"):
        assert res[f"{phase}_floor_s_per_state"] > 0 and res[f"{phase}_over_floor"] > 0
    assert res["kl_mean"] >= 0 and res["prompt_tokens_mean"] > 0 and res["logits"] == "float32"  # the pass's own
