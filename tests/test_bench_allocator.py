"""``sprpo-bench allocator``: a fresh process measures the smoke batch's passes under glibc's own
malloc settings and then tuned, every method from the same adapter state (the same update
losses on both sides), and the report renders the record; a process already tuned is refused."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from sprpo_lib.bench import allocator as bench_alloc
from sprpo_lib.bench.report import SUMMARIES, headline
from sprpo_lib.bench.suite import restore_point
from sprpo_lib.infra import hardware


def test_bench_allocator_measures_both_sides_in_one_fresh_process(tmp_path):
    out = tmp_path / "allocator.json"
    subprocess.run([sys.executable, "-m", "sprpo_lib.bench", "allocator", "--profile", "smoke", "--rounds", "2",
                    "--methods", "vanilla,sprpo", "--out", str(out)], check=True, capture_output=True, text=True)
    rec = json.loads(out.read_text())
    res = rec["results"]
    if res.get("tuned_state") != "tuned":
        pytest.skip(f"no glibc mallopt here: {res.get('tuned_state')}")
    assert rec["machine"]["allocator"] == "tuned"
    for side in bench_alloc.SIDES:
        assert set(res[side]) == {"vanilla", "sprpo", "peak_rss_mib"}
        assert len(res[side]["vanilla"]["update_s_all"]) == 2 and res[side]["vanilla"]["sensitivity_s"] == 0.0
        assert res[side]["sprpo"]["sensitivity_s"] > 0  # the smoke batch has non-zero advantages: the replay ran
    ratio = res["tuned_over_default"]
    assert ratio["sprpo"]["update_s"] == pytest.approx(res["tuned"]["sprpo"]["update_s"] / res["default"]["sprpo"]["update_s"],
                                                       abs=1e-3)
    assert "sensitivity_s" not in ratio["vanilla"]  # no extra pass to compare
    table = "\n".join(SUMMARIES["allocator"](res))
    assert table.index("| vanilla |") < table.index("| sprpo |")
    assert "vanilla update" in headline(rec)


def test_bench_allocator_refuses_a_process_already_tuned(monkeypatch):
    monkeypatch.setattr(hardware, "allocator", lambda: "tuned")
    with pytest.raises(ValueError, match="already tuned"):
        bench_alloc.bench_allocator("smoke", "webshop")
    monkeypatch.setattr(hardware, "allocator", lambda: "default")
    with pytest.raises(ValueError, match="methods among"):
        bench_alloc.bench_allocator("smoke", "webshop", methods=("gaussian",))


def test_restore_point_puts_parameters_and_optimizer_state_back():
    w = torch.nn.Parameter(torch.ones(3))
    actor = type("A", (), {"params": [w], "opt": torch.optim.Adam([w], lr=0.1)})()
    restore = restore_point(actor)
    for _ in range(2):
        (w * w).sum().backward()
        actor.opt.step()
        assert not torch.equal(w.detach(), torch.ones(3)) and actor.opt.state[w]
        restore()
        assert torch.equal(w.detach(), torch.ones(3)) and not actor.opt.state_dict()["state"]
