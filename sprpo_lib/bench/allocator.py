"""``sprpo-bench allocator``: the training passes on one real rollout batch under glibc's own
malloc settings, then under the tuned ones (:func:`sprpo_lib.infra.hardware.set_allocator`),
in one process.

glibc's settings cannot be put back once changed, so the process runs its ``rounds`` under the
settings it started with first, and tunes after: each method's update (and extra pass) is timed
``rounds`` times on each side from the same adapter and optimizer state, with the minor page
faults and the kernel seconds the process spent (``getrusage``) and its peak resident memory
after each side.  The first tuned round also pays for growing the heap once; the median of
three or more rounds leaves it out."""
from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Sequence

from sprpo_lib.bench.suite import method_variants, restore_point, rollout_batch, warm_up
from sprpo_lib.core.methods import make_method
from sprpo_lib.infra import hardware as hw
from sprpo_lib.infra.progress import progress_bar

SIDES = ("default", "tuned")
METHODS = ("vanilla", "sprpo", "sam")


def _usage() -> tuple[int, float, float]:
    """``(minor page faults, kernel seconds, peak resident MiB)`` of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_stime, r.ru_maxrss / 1024


def bench_allocator(profile: str = "cpu", env: str = "webshop", rounds: int = 3,
                    methods: Sequence[str] = METHODS, overrides: Sequence[str] | None = None) -> dict:
    """Per method and side: median seconds of its update and extra pass over ``rounds`` from
    one adapter state, median minor page faults and kernel seconds per iteration's passes,
    and the process's peak resident memory at the end of the side; ``tuned_over_default``:
    the medians' ratios.  Needs a process whose malloc settings were never tuned."""
    if hw.allocator() != "default":
        raise ValueError("bench allocator: this process's malloc settings are already tuned; run it as "
                         "`sprpo-bench allocator` (the CLI leaves them alone for this benchmark)")
    if rounds < 1 or set(methods) - set(METHODS) or not methods:
        raise ValueError(f"bench allocator: expected rounds >= 1 and methods among {METHODS}, got {rounds}, {methods}")
    tr, batch, _, xi, _, setup = rollout_batch(profile, env, overrides)
    cfg = tr.cfg
    variants = method_variants(cfg.method)
    restore = restore_point(tr.actor)
    warm_up(tr, batch, variants["sprpo"], xi)
    res: dict = {"profile": profile, "env": env, "overrides": list(overrides or []), "dtype": tr.dtype,
                 "rounds": rounds, "samples": len(batch.samples), "setup_s": round(setup, 2)}
    bar = progress_bar(total=2 * rounds * len(methods), desc="bench allocator: updates", unit="update")
    for side in SIDES:
        if side == "tuned":
            res["tuned_state"] = hw.set_allocator("tuned")
        rows: dict = {m: {"update_s": [], "sensitivity_s": [], "minor_faults": [], "kernel_s": []} for m in methods}
        for _ in range(rounds):
            for name in methods:
                bar.set_postfix_str(f"{side} {name}", refresh=True)
                restore()
                tr.method = make_method(variants[name], tr.shape, cfg.seed)
                f0, k0, _ = _usage()
                t0 = time.perf_counter()
                st = tr.update(batch.without_old(), xi if name == "sprpo" else None, 0)
                wall = time.perf_counter() - t0
                f1, k1, _ = _usage()
                row = rows[name]
                row["update_s"].append(st["update_s"])
                row["sensitivity_s"].append(st["sensitivity_s"])
                row["minor_faults"].append(f1 - f0)
                row["kernel_s"].append(k1 - k0)
                bar.write(f"  {side} {name}: update {st['update_s']:.1f} s, extra pass {st['sensitivity_s']:.1f} s, "
                          f"{f1 - f0} page faults, {k1 - k0:.2f} s in the kernel ({wall:.1f} s)")
                bar.update()
        res[side] = {name: {**{k: round(statistics.median(v), 3) for k, v in row.items()},
                            "update_s_all": [round(x, 2) for x in row["update_s"]],
                            "sensitivity_s_all": [round(x, 2) for x in row["sensitivity_s"]]}
                     for name, row in rows.items()}
        res[side]["peak_rss_mib"] = round(_usage()[2])
    bar.close()
    res["tuned_over_default"] = {
        name: {k: round(res["tuned"][name][k] / res["default"][name][k], 3)
               for k in ("update_s", "sensitivity_s") if res["default"][name][k] > 0}
        for name in methods}
    return res
