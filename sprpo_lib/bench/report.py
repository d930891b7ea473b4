"""``sprpo-bench report``: every benchmark JSON of the project (``runs/bench/*.json``) as one
Markdown file per machine, ``figures/bench_<machine>.md`` with the JSON it was made from
(each with a manifest), and the README's short ``bench`` block.  Nothing in either is
typed: each line is read off a benchmark's own record, with the machine it ran on."""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

from sprpo_lib.infra.io import CorruptFileError, atomic_write_text, read_json
from sprpo_lib.infra.manifest import not_applicable, write_manifest
from sprpo_lib.infra.paths import figures_dir, project_root, runs_dir
from sprpo_lib.paper.budget import projected_markdown
from sprpo_lib.paper.results import doc_pages, replace_block
from sprpo_lib.paper.style import METHOD_DISPLAY

log = logging.getLogger(__name__)


def machine_of(record: dict) -> dict:
    """The machine facts a benchmark recorded (``results.machine``), or what is known."""
    res = record.get("results") or {}
    m = res.get("machine") if isinstance(res, dict) else None
    top = record.get("machine")
    return m if isinstance(m, dict) else top if isinstance(top, dict) else {"machine": top or "unknown"}


def machine_slug(machine: dict) -> str:
    """A file-name key for a machine: CPU model and CPU class, e.g. ``intel-xeon-processor-amx``,
    or the GPU's name where the record ran with one (``nvidia-h200``): that is what it measured."""
    name = (machine["gpu"] if machine.get("gpu") else
            f"{machine.get('cpu_model') or machine.get('machine', 'unknown')} {machine.get('cpu_class', '')}")
    name = re.sub(r"\((r|tm)\)", "", name.lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def machine_line(machine: dict) -> str:
    keys = ("gpu", "cpu_model", "cpu_class", "capability", "logical_cpus", "torch")
    return ", ".join(f"{k} {machine[k]}" for k in keys if machine.get(k) is not None)


def _all_alike(n: int) -> str:
    """A paired comparison whose every task ended alike, in words: its interval would have
    zero width, which is identical outcomes, not a measured precision."""
    return f"every one of the {n} tasks with the same outcome"


def _eval_rows(res: dict) -> list[str]:
    lines = ["| engine | held-out: wall | episodes/min | wall / prefill floor | least with a prefix cache "
             "(prefilled share + decode floor) | success | paired vs first [95% CI] "
             "| rollout batch: wall (floor ratio) | retries |", "|---|---|---|---|---|---|---|---|---|"]
    for spec, row in res.items():
        if not isinstance(row, dict) or "eval" not in row:
            continue
        ev, ro = row["eval"], row.get("rollout") or {}
        paired = next((v for k, v in ev.items() if k.startswith("paired_vs_")), None)
        pv = (f"{100 * paired['success_diff']:+.1f} pp [{100 * paired['ci95'][0]:+.1f}, {100 * paired['ci95'][1]:+.1f}]"
              if paired else "")
        if paired and paired.get("gained") == paired.get("lost") == 0:
            pv = _all_alike(ev["episodes"])
        rollout = f"{ro['wall_s']} s ({ro['wall_over_prefill_floor']}x)" if ro else ""
        retries = ev.get("engine_retries", 0) + ro.get("engine_retries", 0)
        least = (f"{ev['least_over_prefill_floor']}x ({ev['prefix_cache_factor']} + "
                 f"{ev['decode_over_prefill_floor']})" if "least_over_prefill_floor" in ev else "")
        lines.append(f"| `{spec}` ({row.get('dtype')}) | {ev['wall_s']} s | {ev['episodes_per_min']} | "
                     f"{ev['wall_over_prefill_floor']}x | {least} | {round(100 * ev['success'], 1)}% of {ev['episodes']} | {pv} | "
                     f"{rollout} | {retries} |")
    split = [(spec, row["eval"]) for spec, row in res.items() if isinstance(row, dict) and "prefill_s" in row.get("eval", {})]
    if split:
        lines += ["", "Held-out generation by phase (its calls replayed with one new token each: the prefill alone, "
                  "the prefix cache filled as in the episodes; decode: the rest):", "",
                  "| engine | generation | prefill (x all-token floor, x cached floor) | decode (x its floor) |",
                  "|---|---|---|---|"]
        lines += [f"| `{spec}` | {ev['generate_s']} s | {ev['prefill_s']} s ({ev['prefill_over_floor']}x, "
                  f"{ev['prefill_over_cached_floor']}x) | {ev['decode_s']} s ({ev['decode_over_floor']}x) |"
                  for spec, ev in split]
    return lines


def _churn_rows(res: dict) -> list[str]:
    keys = ("model", "rounds", "builds", "calls", "hangs", "retries", "unrecovered", "mismatches", "injected", "wall_s")
    return ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys),
            "| " + " | ".join(str(res.get(k, "")) for k in keys) + " |"]


def _machine_rows(res: dict) -> list[str]:
    lines = ["| dtype | prefill GFLOP/s | decode GFLOP/s | prefill floor s / 1k tokens |", "|---|---|---|---|"]
    for d, g in res.get("prefill_gflops", {}).items():
        lines.append(f"| {d} | {g} | {res.get('decode_gflops', {}).get(d)} | "
                     f"{res.get('prefill_floor_s_per_1k_tokens', {}).get(d)} |")
    lines.append(f"\nBandwidth {res.get('bandwidth_gbs')} GB/s; faster dtype here: {res.get('fast_dtype')}.")
    return lines


def _flat_rows(res, prefix: str = "") -> list[str]:
    out = []
    for k, v in (res.items() if isinstance(res, dict) else []):
        if k == "machine":
            continue
        if isinstance(v, dict):
            out += _flat_rows(v, f"{prefix}{k}.")
        elif not isinstance(v, list):
            out.append(f"| `{prefix}{k}` | {v} |")
    return out


TRAIN_METHODS = ("vanilla", "sprpo", "sprpo_one_pass", "sprpo_subset", "sam")
#: ``bench train``'s passes, in table order: the reference, the profile's shared prefixes, those
#: with SDPA's attention (speed.attention=sdpa), those with fused kernels (speed.fused_kernels)
#: and those with SPrPO's replay through every layer (speed.replay_graph_gb=0)
TRAIN_PATHS = ("whole", "shared", "sdpa", "fused", "full_replay")


def _overrides_text(res: dict) -> str:
    """`` (update.micro_batch=16)``: the config overrides a record was measured under, if any."""
    return f" ({', '.join(res['overrides'])})" if res.get("overrides") else ""


def _train_rows(res: dict) -> list[str]:
    """``bench train``: per pass layout and method, each phase against its FLOP floor."""
    tok, ro = res.get("tokens", {}), res.get("rollout", {})
    lines = [f"{res.get('env')} `{res.get('profile')}` batch{_overrides_text(res)}: {res.get('samples')} rows "
             f"({res.get('samples_nonzero_adv')} with A != 0), {tok.get('batch')} tokens; computed by a whole-row pass "
             f"{tok.get('whole_computed')} (padding {tok.get('whole_padding')}), by a shared-prefix pass "
             f"{tok.get('shared_computed')} (padding {tok.get('shared_padding')}, {tok.get('prefix_groups')} prefixes), "
             f"by any prefix sharing at least {tok.get('trie_limit')}; "
             f"{res.get('dtype')} matmul {res.get('matmul_gflops')} GFLOP/s"
             + (f" (the faster of {' and '.join(map(str, res['matmul_gflops_probes']))}, before and after the updates)"
                if len(res.get("matmul_gflops_probes") or []) > 1 else "")
             + (f"; float32 matmul {res['matmul_gflops_float32']} GFLOP/s, the rate a float32 update is priced at"
                if res.get("matmul_gflops_float32") else "") + ". "
             + (f"Setup (model, warm start) {res['setup_s']} s, not measured. " if "setup_s" in res else "")
             + f"Rollout {ro.get('rollout_s')} s"
             + (f" ({ro['episodes_played']} episodes in {ro.get('rounds')} rounds)" if "episodes_played" in ro else "")
             + f", generation {ro.get('generate_s')} s = {ro.get('generate_over_floor')}x its floor "
             f"({ro.get('prefill_floor_s')} s prefill + {ro.get('decode_floor_s')} s decode"
             + ("" if "episodes_played" in ro else "; older record: the floor counts the batch's episodes only, "
                "not those of refill rounds") + ").\n",
             "| passes | method | update s (x floor) | s / row | extra pass s (x floor) | iteration s | x Vanilla |",
             "|---|---|---|---|---|---|---|"]
    for path in TRAIN_PATHS:
        rows = res.get(path)
        if not isinstance(rows, dict):
            continue
        for m in TRAIN_METHODS:
            r = rows.get(m)
            if not isinstance(r, dict):
                continue
            extra = f"{r['sensitivity_s']} ({r.get('sensitivity_over_floor')}x)" if r.get("sensitivity_s") else "-"
            ratio = rows.get(f"{m}_over_vanilla", 1.0)
            steps = r.get("ppo_steps")
            label = m if steps is None or steps == rows["vanilla"].get("ppo_steps") else f"{m} ({steps:g} step)"
            if r.get("update_dtype") == "float32":  # SAM: xi below bfloat16's resolution (perturb.below_resolution)
                label += " (float32 update)"
            lines.append(f"| {path} | {label} | {r['update_s']} ({r.get('update_over_floor')}x) | "
                         f"{r['update_s_per_sample']} | {extra} | {r['iteration_s']} | {ratio} |")
    first = next((r for r in (res.get("shared") or {}).values() if isinstance(r, dict)), {})
    if (res.get("ppo_mini_batch_size") or 0) and "ppo_steps" not in first:
        lines.append("\nOlder record: its update floors leave out the forward pass that fills the old log-probs "
                     "before mini-batched steps, so these update / floor ratios are overstated.")
    bounds = res.get("shared") or {}
    ref = ((res.get("whole") or {}).get("vanilla") or {})
    if ref.get("update_floor_s") and (bounds.get("vanilla") or {}).get("update_floor_s"):
        # the same rows on both paths: their FLOP ratio is what the s/row ratio reaches at equal seconds per FLOP
        van = bounds["vanilla"]
        lines.append(f"\nVanilla's shared-pass update is {round(van['update_floor_s'] / ref['update_floor_s'], 3)}x the "
                     f"whole path's FLOPs: its seconds per row reach that ratio at the whole path's seconds per FLOP "
                     f"(measured: {round(van['update_s'] / ref['update_s'], 3)}x).")
    if bounds.get("sprpo_over_vanilla_bound"):
        lines.append(f"\nWith the extra pass at its floor (shared passes): SPrPO (replay) at least "
                     f"{bounds['sprpo_over_vanilla_bound']}x Vanilla"
                     + (f", SAM at least {bounds['sam_over_vanilla_bound']}x." if "sam_over_vanilla_bound" in bounds else "."))
    at = {m: bounds[f"{m}_over_vanilla_at_floors"] for m in ("sprpo", "sam") if f"{m}_over_vanilla_at_floors" in bounds}
    if at:
        lines.append("With generation, update and extra pass all at their floors (what the methods' work alone costs): "
                     + ", ".join(f"{'SPrPO' if m == 'sprpo' else 'SAM'} {v}x Vanilla" for m, v in at.items()) + ".")
    if isinstance(res.get("fused_over_shared"), dict):
        lines.append("\nFused kernels (speed.fused_kernels: RMSNorm, SwiGLU, rotary compiled): update seconds "
                     "over the eager shared passes' (below 1: faster): "
                     + ", ".join(f"{m} {v}x" for m, v in res["fused_over_shared"].items()) + ".")
    if isinstance(res.get("sdpa_over_shared"), dict):
        lines.append(f"\nSDPA's attention (speed.attention=sdpa) against the profile's ({res.get('attention')}, "
                     f"{res.get('dtype')}): update seconds over the shared passes' (above 1: SDPA slower): "
                     + ", ".join(f"{m} {v}x" for m, v in res["sdpa_over_shared"].items())
                     + "; extra pass: " + (", ".join(f"{m} {v}x" for m, v in (res.get("sdpa_extra_over_shared") or {}).items())
                                           or "none") + ".")
    lines += _replay_graph_lines(res)
    for key, what in (("one_pass_vs_replay", "One-pass"),
                      ("subset_vs_replay", f"Subset ({res.get('replay_rows')} rows, replay_frac {res.get('replay_frac')})")):
        cmp = res.get(key)
        if isinstance(cmp, dict):
            lines.append(f"\n{what} S_hat against the replay's on this batch: Spearman {cmp.get('S_spearman')}, "
                         f"relative L2 {cmp.get('S_rel_l2')}, m_hat relative difference {cmp.get('m_hat_rel_diff')}"
                         + (f", sigma relative L2 {cmp['sigma_rel_l2']}" if "sigma_rel_l2" in cmp else "") + ".")
    return lines


def _replay_graph_lines(res: dict) -> list[str]:
    """``bench train``: SPrPO's replay from the graph its update kept (speed.replay_graph_gb), its
    seconds and S_hat against the replay through every layer (the ``full_replay`` path)."""
    lines = []
    for path, g in (res.get("replay_graph") or {}).items():
        lines.append(f"\n{path}: SPrPO's update kept the graph below the LoRA layers for {g['rows']} of the replay's "
                     f"{g['replay_rows']} rows ({g['kept_gib']} GiB of a {g['budget_gib']} GiB budget, "
                     "speed.replay_graph_gb); their replay ran the LoRA layers and one backward through it.")
    if "full_replay_extra_over_shared" in res:
        lines.append(f"SPrPO's replay through every layer (speed.replay_graph_gb=0) took "
                     f"{res['full_replay_extra_over_shared']}x the seconds of the replay from the kept graph.")
    if isinstance(res.get("graph_vs_full_replay"), dict):
        cmp = res["graph_vs_full_replay"]
        lines.append(f"Its S_hat against the replay through every layer's (the same update): Spearman "
                     f"{cmp.get('S_spearman')}, relative L2 {cmp.get('S_rel_l2')}, m_hat relative difference "
                     f"{cmp.get('m_hat_rel_diff')}.")
    return lines


def _full_replay_phrase(res: dict) -> str:
    """The headline's clause on the replay through every layer against the kept graph's, if measured."""
    if "full_replay_extra_over_shared" not in res:
        return ""
    return (f"; SPrPO's replay through every layer {res['full_replay_extra_over_shared']}x the one from the "
            f"kept graph, SPrPO {res['full_replay']['sprpo_over_vanilla']}x Vanilla there")


def _diff_text(res: dict) -> str:
    """``configs differ in speed.prefix_min 0 -> 16, ...``: what two compared sets of runs differ in."""
    diff = ", ".join(f"{k} {b} -> {a}" for k, (b, a) in (res.get("config_diff") or {}).items())
    return f"configs differ in {diff}" if diff else "the same config"


def _heldout_text(h: dict) -> str:
    """Held-out success before -> after with the paired test, or that every task ended alike
    (then the interval has zero width: identical outcomes, not a measured precision)."""
    if h["only_after"] == h["only_before"] == 0:
        return f"{h['before']}% on both sides, {_all_alike(h['tasks'])}"
    return (f"{h['before']} -> {h['after']}%, {h['diff_pp']:+} pp [{h['ci_pp'][0]:+}, {h['ci_pp'][1]:+}] "
            f"(MDE80 {h['mde80_pp']} pp; {h['only_after']}/{h['only_before']} tasks solved by one side, p {h['sign_p']})")


def _in_method_order(rows: dict) -> list[tuple[str, dict]]:
    """``rows`` (method -> row) in the figures' method order (a JSON record keeps its keys sorted)."""
    order = list(METHOD_DISPLAY)
    return sorted(rows.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))


def _runs_rows(res: dict) -> list[str]:
    """``bench runs``: per method, seconds before -> after and whether the two learned alike."""
    pooled = res.get("heldout_pooled") or {}
    lines = [(f"{res.get('env')} `{res.get('profile')}` runs, seed {res.get('seed')}: `{res.get('before_root')}` "
              f"(before) against `{res.get('after_root')}` (after), {_diff_text(res)}. "
              f"Held-out success of the final policies, pooled over the methods ({pooled.get('tasks')} paired "
              f"tasks): {_heldout_text(pooled) if pooled else '-'}.\n"),
             ("| method | iteration s | update s | update s / row | extra pass s | same first rollout: its update "
              "(and extra pass) s | rollout success per iteration | held-out success |"), "|---|---|---|---|---|---|---|---|"]
    for m, r in _in_method_order(res.get("methods") or {}):
        b, a = r["before"], r["after"]
        extra = f"{b['extra_s']} -> {a['extra_s']} ({r['extra_ratio']}x)" if r.get("extra_ratio") else "-"
        curve = " / ".join(",".join(f"{v:g}" for v in p["success"]) for p in (b, a))
        fb = r.get("first_batch")
        # a record from before ``first_batch`` existed says only whether the first rollouts matched
        first = ("yes" if r.get("first_rollout_same") else "no") if not fb else ("yes: " + " -> ".join(map(str, fb["update_s"])) + f" ({fb['update_ratio']}x)"
                                     + (f"; {' -> '.join(map(str, fb['extra_s']))} ({fb['extra_ratio']}x)"
                                        if fb.get("extra_ratio") else ""))
        lines.append(f"| {m} | {b['iteration_s']} -> {a['iteration_s']} ({r['iteration_ratio']}x) | {b['update_s']} -> "
                     f"{a['update_s']} ({r['update_ratio']}x) | {b['update_s_per_sample']} -> {a['update_s_per_sample']} "
                     f"({r['update_per_sample_ratio']}x) | {extra} | {first} | "
                     f"{curve} | {_heldout_text(r['heldout'])} |")
    return lines


def _gpu_rows(res: dict) -> list[str]:
    """``bench gpu``: per environment the rollout and each method's update on its batch, and on a
    micro-batch at the full prompt budget, seconds and peak memory (allocated, and held by the
    caching allocator); per engine, generation against the decode floor."""
    gpu = res.get("gpu", {})
    tests = res.get("cuda_tests", {})
    lines = [f"{gpu.get('name', res.get('device'))} ({gpu.get('memory_gib', '?')} GiB), `{res.get('profile')}` profile, "
             f"`{res.get('model')}`, {res.get('env_max_steps')} steps per episode; CUDA tests: "
             f"{tests.get('passed', '-')} passed, {tests.get('failed', 0)} failed; "
             f"measured memory bandwidth {res.get('bandwidth_gbs')} GB/s.\n"]
    for name, g in (res.get("generation") or {}).items():
        split = ("" if "prefill_s" not in g else
                 f" Prefill (one new token) {g['prefill_s']} s against its floor {g['prefill_floor_s']} s "
                 f"({g['matmul_gflops']} GFLOP/s); decoding {g['decode_s']} s, {g['decode_floor_over_decode']} of its floor.")
        lines.append(f"`{name}` generation: " + (f"failed: {g['error'][:200]}" if "error" in g else
                     f"{g['tokens_per_s']} new tokens/s at batch {g['batch']}, "
                     f"{g['floor_over_wall']} of the decode floor ({g['decode_floor_s']} s against {g['wall_s']} s)."
                     + split))
    envs = [(env, rows) for env, rows in res.items() if isinstance(rows, dict) and env not in ("gpu", "cuda_tests", "generation")]
    if envs:
        lines += ["\n| env | phase | samples / tokens | seconds | extra pass s | peak GiB |", "|---|---|---|---|---|---|"]
    for env, rows in envs:
        if "error" in rows:
            lines.append(f"| {env} | stopped: {rows['error'][:200]} | | | | |")
        r = rows.get("rollout")
        if isinstance(r, dict):
            lines.append(f"| {env} | rollout ({r['episodes']} episodes; generation {r['generate_s']} s) | "
                         f"{r['samples']} / {r['tokens']} | {r['rollout_s']} | | "
                         f"{r.get('rollout_peak_cuda_gib', r.get('rollout_peak_rss_gib'))}" +
                         (f" (held {r['rollout_peak_cuda_reserved_gib']})" if "rollout_peak_cuda_reserved_gib" in r else "")
                         + " |")
        if "warmup_s" in rows:
            lines.append(f"| {env} | Vanilla update, untimed warm-up before the rows below | | {rows['warmup_s']} | | |")
        fb = rows.get("full_budget") or {}
        if "skipped" in fb:
            lines.append(f"| {env} | full budget | skipped ({fb['skipped']}) | | | |")
        for m, r in [*rows.items(), *((f"{m} at the full budget", r) for m, r in fb.items())]:
            if m in ("rollout", "full_budget") or not isinstance(r, dict):
                continue
            size = f"{fb['rows']} x {fb['tokens_per_row']}" if m.endswith("full budget") else ""
            if "skipped" in r:
                lines.append(f"| {env} | {m} update | skipped ({r['skipped']}) | | | |")
            else:
                peak = r.get("update_peak_cuda_gib", r.get("update_peak_rss_gib"))
                held = (f" (held {r['update_peak_cuda_reserved_gib']})" if "update_peak_cuda_reserved_gib" in r else "")
                lines.append(f"| {env} | {m} update | {size} | {r.get('update_s')} | {r.get('sensitivity_s')} | "
                             f"{peak}{held} |")
        for what, phases in (("rollout's batch", rows), ("full budget", fb)):
            alloc, held = gpu_peaks(phases)
            if alloc:
                card = gpu.get("memory_gib")
                free = f"; {1 - alloc / card:.0%} of the card free" if card else ""
                lines.append(f"| {env} | peak, {what} | | | | {alloc}{free}" +
                             (f" (reserve {held})" if held and res.get("reserve_per_phase") else "") + " |")
    if not res.get("reserve_per_phase") and envs:
        lines.append("\n`held`: the caching allocator's reserve, which this record did not reset between stages: "
                     "a stage's figure includes what earlier stages left cached.")
    projected = projected_markdown({"results": res, "name": "this record"})
    if projected:  # one paper-profile run per method and env, and the grid, from these phases
        lines += ["", projected.rstrip("\n")]
    return lines


def gpu_peaks(phases: dict) -> tuple[float, float]:
    """``bench gpu``: the largest ``torch.cuda.max_memory_allocated`` and reserve (GiB) over
    these phases' rows (rollout and updates); 0 where none was measured."""
    rows = [r for r in phases.values() if isinstance(r, dict)]
    return tuple(max((r.get(f"{p}_{key}", 0) for r in rows for p in ("rollout", "update")), default=0)
                 for key in ("peak_cuda_gib", "peak_cuda_reserved_gib"))


def _ops_rows(res: dict) -> list[str]:
    """``bench ops``: one update's seconds by op class, each against its roofline; for SPrPO its
    S_hat replay's (Alg. 1 line 7) after it, the same way."""
    method = METHOD_DISPLAY[res.get("method", "vanilla")].label
    lines = [(f"{res.get('env')} `{res.get('profile')}`{_overrides_text(res)} batch of {res.get('samples')} rows, "
              f"{res.get('dtype')}, {res.get('ppo_steps')} optimizer steps: {method}'s update {res.get('update_s')} s = "
              f"{res.get('update_over_floor')}x its FLOP floor ({res.get('floor_s')} s); every op timed where it ran "
              f"(the spied update took {res.get('spied_update_s')} s). Rooflines: the matmul rate probed at the model's "
              f"shapes ({res.get('matmul_gflops')} GFLOP/s), the memory bandwidth ({res.get('bandwidth_gbs')} GB/s).\n"),
             *_ops_phase_rows(res, "update")]
    extra = res.get("extra")
    if extra:
        lines += [(f"\n{method}'s S_hat replay (Alg. 1 line 7) {extra.get('extra_s')} s = {extra.get('extra_over_floor')}x "
                   f"its FLOP floor ({extra.get('floor_s')} s; spied {extra.get('spied_extra_s')} s):\n"),
                  *_ops_phase_rows(extra, "replay")]
    return lines


def _ops_phase_rows(res: dict, name: str) -> list[str]:
    """``bench ops``: one phase's table by op class, its eager bound, its matmuls by size and role."""
    lines = [f"| class | seconds (share of the {name}) | calls | work | rate (x roofline) | at the roofline s | top ops (s) |",
             "|---|---|---|---|---|---|---|"]
    for cls, r in (res.get("classes") or {}).items():
        rate = f"{r['rate']} ({r['rate_over_roofline']}x)" if "rate" in r else "-"
        top = ", ".join(f"{t['op']} {t['seconds']}" for t in r.get("top", [])[:4])
        lines.append(f"| {cls} | {r['seconds']} ({r['share_of_wall']}) | {r['calls']} | {r['work']} {r['unit']} | {rate} | "
                     f"{r.get('at_roofline_s', '-')} | {top} |")
    lines.append(f"| outside the ops (Python, autograd engine) | {res.get('outside_ops_s')} | | | | 0 | |")
    lines.append(f"\nEager bound (matmuls and memory ops at their rooflines, attention as measured, nothing outside the "
                 f"ops): {res.get('eager_bound_s')} s = {res.get('eager_bound_over_floor')}x the FLOP floor.")
    if res.get("matmul_sizes"):
        lines += ["\nMatmuls by their smallest dimension (rows, inner or columns):\n",
                  "| smallest dimension | seconds (share of the matmuls) | calls | GFLOP | x roofline |", "|---|---|---|---|---|"]
        lines += [f"| {r['size']} | {r['seconds']} ({share}) | {r['calls']} | {r['gflop']} | {r['rate_over_roofline']} |"
                  for r, share in zip(res["matmul_sizes"], _size_shares(res))]
    if res.get("matmul_roles"):
        lines += ["\nMatmuls by role (seconds above the roofline: their seconds less their GFLOP at the matmul rate):\n",
                  "| role | seconds | calls | GFLOP | x roofline | seconds above the roofline |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['role']} | {r['seconds']} | {r['calls']} | {r['gflop']} | {r['rate_over_roofline']} | "
                  f"{r['above_roofline_s']} |" for r in res["matmul_roles"]]
    return lines


def _size_shares(res: dict) -> list[float]:
    """``bench ops``: each matmul size bin's share of the matmuls' seconds."""
    sizes = res.get("matmul_sizes") or []
    total = sum(r["seconds"] for r in sizes) or 1.0
    return [round(r["seconds"] / total, 3) for r in sizes]


def _thin_matmuls(res: dict) -> str:
    """``bench ops`` headline tail: the share of matmul time in the lowest size bin, and its rate."""
    sizes = res.get("matmul_sizes") or []
    if not sizes or not sizes[0]["size"].startswith("<=") or not sum(r["seconds"] for r in sizes):
        return ""
    low = sizes[0]
    return (f"; matmuls with a dimension {low['size'].split(' (')[0]} {_size_shares(res)[0]} of the matmul "
            f"time at {low['rate_over_roofline']}x the rate")


def _divergence_rows(res: dict) -> list[str]:
    """The divergence pass per state at each batch size, each phase against its floor."""
    rows = ["| what | value |", "|---|---|",
            *_flat_rows({k: v for k, v in res.items() if k not in _DIVERGENCE_PHASE and k != "batch"})]
    runs = res.get("by_batch") or [res]
    rows += ["", "| states per batch | padded tokens per batch | attention | logits | batches | padded prompt tokens | "
             "clean side s/state (x floor) | one setting s/state (x floor) | mean KL | flip rate |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows += [f"| {r.get('batch', 1)} | {r.get('batch_tokens') or '-'} | {r.get('attention', 'sdpa')} | "
             f"{r.get('logits', 'model')} | "
             f"{r.get('batches', '')} | {r.get('padded_tokens', '')} | {r['clean_s_per_state']} ({r['clean_over_floor']}x) | "
             f"{r['setting_s_per_state']} ({r['setting_over_floor']}x) | {r['kl_mean']} | {r.get('flip_rate', '')} |"
             for r in runs]
    return rows


def _divergence_variant(r: dict) -> str:
    """How a run of the divergence bench batched, attended and rounded its logits, in words (older
    records: the batch size alone)."""
    out = f"{r.get('batch', 1)} state{'s' if r.get('batch', 1) != 1 else ''} per batch"
    if r.get("batch_tokens"):
        out += f" within {r['batch_tokens']} padded tokens"
    out += f", {r['attention']} attention" if r.get("attention") else ""
    return out + (f", {r['logits']} logits" if r.get("logits") else "")


_DIVERGENCE_PHASE = ("response_tokens_mean", "clean_s_per_state", "clean_floor_s_per_state", "clean_over_floor",
                     "setting_s_per_state", "setting_floor_s_per_state", "setting_over_floor", "kl_mean", "flip_rate")


def _divergence_headline(res: dict) -> str | None:
    runs = res.get("by_batch") or [res]
    first, last = runs[0], runs[-1]
    out = (f"{res.get('env')} divergence per state ({res.get('samples')} samples, {res.get('setting')}): one setting "
           f"{last['setting_s_per_state']} s ({last['setting_over_floor']}x its floor), clean side "
           f"{last['clean_s_per_state']} s ({last['clean_over_floor']}x)")
    if len(runs) > 1:
        out += (f" at {_divergence_variant(last)}; "
                f"{round(first['setting_s_per_state'] / last['setting_s_per_state'], 2)}x / "
                f"{round(first['clean_s_per_state'] / last['clean_s_per_state'], 2)}x faster than at "
                f"{_divergence_variant(first)} (setting / clean side)")
    if first.get("logits", "model") != last.get("logits", "model"):
        out += (f"; mean KL {first['kl_mean']} with {first.get('logits', 'model')} logits, {last['kl_mean']} with "
                f"{last.get('logits', 'model')}")
    return out


def _host_rows(res: dict) -> list[str]:
    """A decode step's milliseconds per engine, inside and outside the model's forward."""
    rows = [f"{res.get('layers')} layers, {res.get('hidden_size')} channels, batch {res.get('batch')}, "
            f"{res.get('new_tokens')} new tokens, {res.get('threads')} thread(s).", "",
            "| engine | ms per decode step | inside the forward | outside (the engine's host work) | outside, mean | "
            "decode steps | greedy tokens equal to hf |", "|---|---|---|---|---|---|---|"]
    for name, r in (res.get("engines") or {}).items():
        rows.append(f"| `{name}` | failed: {r['error'][:200]} | | | | | |" if "error" in r else
                    f"| `{name}` | {r['step_ms']} | {r['forward_ms']} | {r['outside_ms']} | {r.get('outside_mean_ms', '-')} | "
                    f"{r['decode_steps']} | "
                    f"{r.get('greedy_equal', '-')} |")
    return rows


def _host_headline(res: dict) -> str | None:
    eng = {n: r for n, r in (res.get("engines") or {}).items() if "error" not in r}
    if not eng:
        return None
    return "decode step host time at batch {}: {}".format(
        res.get("batch"), ", ".join(f"`{n}` {r['step_ms']} ms ({r['outside_ms']} outside the forward)"
                                    for n, r in eng.items()))


SUMMARIES = {"eval": _eval_rows, "churn": _churn_rows, "machine": _machine_rows, "train": _train_rows, "gpu": _gpu_rows,
             "runs": _runs_rows, "ops": _ops_rows,
             "divergence": _divergence_rows, "host": _host_rows}


def _eval_headline(spec: str, ev: dict) -> str:
    """:func:`headline` of one engine's held-out run: its rate, wall over the prefill floor, the
    least that can be, and with ``--phases`` its prefill and decoding against their floors."""
    out = f"`{spec}` {ev['episodes_per_min']} held-out episodes/min, {ev['wall_over_prefill_floor']}x its prefill floor"
    if "least_over_prefill_floor" in ev:
        out += (f" (at least {ev['least_over_prefill_floor']}x with an unlimited prefix cache "
                "and decoding at its floor)")
    if "prefill_s" in ev:
        out += (f"; its prefill {ev['prefill_over_floor']}x the floor ({ev['prefill_over_cached_floor']}x the "
                f"cached floor), its decoding {ev['decode_over_floor']}x its floor")
    return out


def _ops_headline(res: dict) -> str | None:
    """``bench ops``' phrase: the update against its floor, each op class against its roofline."""
    if not isinstance(res.get("classes"), dict):
        return None
    method = METHOD_DISPLAY[res.get("method", "vanilla")].label
    extra = res.get("extra")
    return (f"{res.get('env')} {method} update {res.get('update_over_floor')}x its floor: {_ops_classes_phrase(res)}"
            + (f"; its S_hat replay {extra['extra_over_floor']}x its floor: {_ops_classes_phrase(extra)}" if extra else ""))


def _ops_classes_phrase(res: dict) -> str:
    """``bench ops``: one phase's op classes against their rooflines, its eager bound, its thin matmuls."""
    c = res["classes"]
    return (f"matmuls {c['matmul'].get('rate_over_roofline')}x their rate, memory ops {c['memory'].get('rate_over_roofline')}x "
            f"the bandwidth, attention {c['attention']['seconds']} s; eager bound {res.get('eager_bound_over_floor')}x the floor"
            + _thin_matmuls(res))


def _sft_headline(res: dict) -> str | None:
    """``bench sft``: the step on both paths against its floor, and their ratio."""
    if "levers" not in res:
        return None
    lev, ref = res["levers"], res["reference"]
    return (f"{res.get('env')} warm-start SFT step ({res.get('tokens_per_step')} tokens, {res.get('dtype')}) "
            f"{lev['s_per_step']} s ({lev['over_floor']}x its floor) with the speed levers, {ref['s_per_step']} s "
            f"({ref['over_floor']}x) on the reference path: {res.get('levers_over_reference')}x")


#: the benchmarks whose README phrase has its own function (the rest: in :func:`headline`)
HEADLINES = {"ops": _ops_headline, "sft": _sft_headline,
             "divergence": _divergence_headline, "host": _host_headline}


def headline(record: dict) -> str | None:
    """One phrase of a benchmark's main numbers for the README, or None."""
    name, res = record.get("bench"), record.get("results") or {}
    if name in HEADLINES:
        return HEADLINES[name](res)
    if name == "eval":
        return "; ".join(_eval_headline(spec, row["eval"]) for spec, row in res.items()
                         if isinstance(row, dict) and "eval" in row)
    if name == "churn":
        return f"{res.get('hangs')} hangs and {res.get('retries')} retries in {res.get('builds')} engine builds"
    if name == "train" and isinstance(res.get("shared"), dict):
        sh, wh = res["shared"], res.get("whole") or {}
        van = sh["vanilla"]
        out = (f"{res.get('env')}{_overrides_text(res)} update {van['update_s']} s ({van.get('update_over_floor')}x its floor)"
               + (f" against {wh['vanilla']['update_s']} s on the reference path ("
                  + ("every row whole, every layer at every step" if "ppo_steps" in van else "every row whole") + ")"
                  if "vanilla" in wh else ""))
        ratios = [form.format(sh[key]) for key, form in (
            ("sprpo_over_vanilla", "SPrPO {} (replay)"), ("sprpo_one_pass_over_vanilla", "{} (one pass)"),
            ("sprpo_subset_over_vanilla", f"{{}} (replay_frac {res.get('replay_frac')})"), ("sam_over_vanilla", "SAM {}"))
            if key in sh]
        at = [f"{label} {sh[f'{m}_over_vanilla_at_floors']}" for m, label in (("sprpo", "SPrPO"), ("sam", "SAM"))
              if f"{m}_over_vanilla_at_floors" in sh]
        fused = res.get("fused_over_shared") or {}
        return (out + "; iteration x Vanilla: " + ", ".join(ratios)
                + (f" (every phase at its floor: {', '.join(at)})" if at else "")
                + (f"; fused kernels: Vanilla's update {fused['vanilla']}x the eager one's" if "vanilla" in fused else "")
                + _full_replay_phrase(res))
    if name == "gpu":
        envs = {env: gpu_peaks(rows)[0] for env, rows in res.items()
                if isinstance(rows, dict) and env not in ("gpu", "cuda_tests", "generation")}
        peaks = [f"{env} peak {alloc} GiB allocated ({gpu_peaks(res[env].get('full_budget') or {})[0]} GiB at the full "
                 f"prompt budget)" for env, alloc in envs.items() if alloc]
        hf = (res.get("generation") or {}).get("hf", {})
        tests = res.get("cuda_tests") or {}
        return ", ".join(([f"CUDA tests {tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed"] if tests else [])
                         + peaks + ([f"hf generation {hf['floor_over_wall']} of the decode floor"] if "floor_over_wall" in hf
                                    else [])
                         + (["partial run"] if record.get("partial") else [])) or None
    if name == "prompts" and isinstance(res.get("prefix_reuse"), dict):
        return (f"{res.get('env')} {res.get('mean_total_tokens')} prompt tokens per step, of which a prefix cache of any size "
                f"leaves at least {res['prefix_reuse']['floor_factor']}x of the all-token prefill floor")
    if name == "runs" and isinstance(res.get("methods"), dict):
        h = res.get("heldout_pooled") or {}
        same = all(r.get("same_curves") for r in res["methods"].values())
        held = ("" if not h else f"; every held-out task ({h['tasks']}) with the same outcome"
                if h["only_after"] == h["only_before"] == 0 else
                f"; held-out success after - before {h['diff_pp']:+} pp [{h['ci_pp'][0]:+}, {h['ci_pp'][1]:+}] "
                f"(MDE80 {h['mde80_pp']} pp)")
        return (f"{res.get('env')} RL runs ({_diff_text(res)}): iteration "
                + ", ".join(f"{m} {r['iteration_ratio']}x" for m, r in _in_method_order(res["methods"]))
                + ("; the same success and valid-action rate at every iteration" if same else "") + held)
    if name == "generate":
        alone = res.get("new_tokens") == 1 and res.get("prefix_caching") is False
        rows = [f"`{eng}:{dtype}` T={t[1:]} {row['wall_over_prefill_floor']}x its prefill floor"
                for dtype, temps in res.items() if dtype in ("float32", "bfloat16") and isinstance(temps, dict)
                for t, engines in temps.items() for eng, row in engines.items() if "wall_over_prefill_floor" in row]
        return ("; ".join(rows) + (" (one new token, no prefix cache: the prefill alone)" if alone else "")) or None
    if name == "machine":
        return ", ".join(f"{d} {g} GFLOP/s" for d, g in res.get("prefill_gflops", {}).items()) + " prefill matmul"
    return None


def main_record(records: list[tuple[Path, dict]], what: str, env: str, has: str | None = None) -> dict | None:
    """The results of benchmark ``what`` on ``env`` that the README's overview reads: the record
    named ``<what>_<env>`` or ``<what>``, else the newest one of that benchmark on ``env``; a
    record measured under config overrides (a lever's variant) or of another method than Vanilla
    (``bench ops --method``) is never the main one.  ``has``:
    only records whose shared path measured that ratio (SAM's, which not every train run times)."""
    def fits(rec: dict) -> bool:
        res = rec.get("results") or {}
        return (rec.get("bench") == what and res.get("env") == env and not res.get("overrides")
                and res.get("method", "vanilla") == "vanilla" and (has is None or has in (res.get("shared") or {})))

    found = [(p, r) for p, r in records if fits(r)]
    named = [(p, r) for p, r in found if p.stem in (f"{what}_{env}", what)]
    pick = max(named or found, key=lambda pr: str(pr[1].get("date", "")), default=None)
    return pick[1]["results"] if pick else None


OVERVIEW_HEADER = ("| machine | env | update / FLOP floor | update s/row: profile / reference path | SPrPO / Vanilla "
                   "| SAM / Vanilla | held-out eval / prefill floor | train dtype |\n|---|---|---|---|---|---|---|---|")


OVERVIEW_NOTE = ("Update: Vanilla's PPO update on one rollout batch of the `cpu` profile (`sprpo-bench train`), against "
                 "its FLOP floor at the matmul rate measured in the same run; the eager bound (`sprpo-bench ops`) puts "
                 "every op at its roofline. Seconds per row: the profile's passes against the reference path (every row "
                 "whole, every layer at every step) in the same run. SPrPO and SAM: seconds per iteration over "
                 "Vanilla's, in brackets with every phase at its floor (SAM's from the newest such run that timed it). Held-out eval: wall over the all-token prefill "
                 "floor for the first engine measured, in brackets the least with an unlimited prefix cache and "
                 "decoding at its floor.")


def _ratio_cell(sh: dict, method: str) -> str:
    """A method's iteration over Vanilla's, with every phase at its floor in brackets."""
    if f"{method}_over_vanilla" not in sh:
        return "-"
    at = sh.get(f"{method}_over_vanilla_at_floors")
    return f"{sh[f'{method}_over_vanilla']}" + (f" ({at})" if at is not None else "")


def overview_row(machine: dict, env: str, records: list[tuple[Path, dict]]) -> str | None:
    """One overview line: ``env``'s main ``train``, ``ops`` and ``eval`` records on one machine
    (:func:`main_record`), "-" where one was not measured; None when none was."""
    train, ops, ev = (main_record(records, what, env) for what in ("train", "ops", "eval"))
    if not (train or ops or ev):
        return None
    train = train or {}
    sh = train.get("shared") or {}
    van = sh.get("vanilla") or {}
    whole = ((train.get("whole") or {}).get("vanilla") or {}).get("update_s_per_sample")
    floor = f"{van['update_over_floor']}x" if "update_over_floor" in van else "-"
    if ops and ops.get("eager_bound_over_floor") is not None:
        floor += f" (eager bound {ops['eager_bound_over_floor']}x)"
    per_row = "-"
    if "update_s_per_sample" in van:
        mine = van["update_s_per_sample"]
        per_row = f"{mine} / {whole} s = {mine / whole:.3f}x" if whole else f"{mine} s"
        per_row += "" if "ppo_steps" in van else " (reference: rows whole only)"
    sam = main_record(records, "train", env, has="sam_over_vanilla") or {}
    spec, row = next(((s, r["eval"]) for s, r in (ev or {}).items() if isinstance(r, dict) and "eval" in r), (None, None))
    held = "-" if row is None else (f"{row['wall_over_prefill_floor']}x" + (
        f" (least {row['least_over_prefill_floor']}x)" if "least_over_prefill_floor" in row else "") + f", `{spec}`")
    name = f"{machine.get('cpu_model', '?')} ({machine.get('cpu_class', '?')})"
    return (f"| {name} | {env} | {floor} | {per_row} | {_ratio_cell(sh, 'sprpo')} | {_ratio_cell(sam.get('shared') or {}, 'sam')} | {held} "
            f"| {train.get('dtype', '-')} |")


def readme_block(machines: list[tuple[str, list[tuple[Path, dict]]]]) -> str:
    """The README's ``bench`` block: one overview table of each CPU machine's main records per
    environment (:func:`overview_row`), then a link to each machine's tables, which open with
    every record's :func:`headline` (``machines``: the tables' file name and its records)."""
    rows, links = [], []
    for md_name, records in machines:
        machine = machine_of(records[0][1])
        if not machine.get("gpu"):
            rows += [r for env in ("webshop", "alfworld") if (r := overview_row(machine, env, records))]
        links.append(f"[{machine_title(machine, md_name)}](figures/{md_name})")
    table = [OVERVIEW_HEADER + "\n" + "\n".join(rows), OVERVIEW_NOTE] if rows else []
    return "\n\n".join(table + ["Every record, per machine: " + " · ".join(links) + "."]) + "\n"


def machine_title(machine: dict, fallback: str = "?") -> str:
    """A machine as its pages name it: the GPU (with its host) or the CPU, and its class."""
    host = f"host {machine.get('cpu_model')}, " if machine.get("gpu") else ""
    return f"{machine.get('gpu') or machine.get('cpu_model', fallback)} ({host}class {machine.get('cpu_class', '?')})"


def headlines(records: list[tuple[Path, dict]]) -> str:
    """Every record's :func:`headline`, one line each (its name where it has none)."""
    return "\n".join(f"- `{p.stem}`: {h}" if (h := headline(rec)) else f"- `{p.stem}`" for p, rec in records) + "\n"


def section(record: dict, path: Path) -> str:
    """One benchmark's Markdown: its command name, date, wall time and table (and, for a run
    that was stopped before its end, that it is partial)."""
    name, res = record.get("bench", path.stem), record.get("results") or {}
    rows = SUMMARIES.get(name, lambda r: ["| what | value |", "|---|---|", *_flat_rows(r)])(res)
    cut = ("**Partial: the run was stopped after the stages below; what is missing did not run.**\n\n"
           if record.get("partial") else "")
    return (f"### `{path.stem}` (`sprpo-bench {name}`, {record.get('date', '')[:10]}, {record.get('wall_s')} s)\n\n"
            + cut + "\n".join(rows) + "\n")


def collect(bench_dir: Path) -> dict[str, list[tuple[Path, dict]]]:
    """Benchmark records per machine slug (unreadable files are skipped with a warning)."""
    out: dict[str, list[tuple[Path, dict]]] = {}
    for path in sorted(bench_dir.glob("*.json")):
        try:
            rec = read_json(path)
        except CorruptFileError as err:
            log.warning("%s", err.with_fix("skipped in the report; run the benchmark again"))
            continue
        if isinstance(rec, dict) and "bench" in rec:
            out.setdefault(machine_slug(machine_of(rec)), []).append((path, rec))
    return out


def report(bench_dir: Path | None = None, out_dir: Path | None = None, readme: Path | None = None) -> list[Path]:
    """Write ``bench_<machine>.md`` / ``.json`` per machine whose tables changed (an unchanged
    machine's files keep their manifests) and refresh the ``bench`` block of the page that has
    it (the library's page, or ``readme``).  Returns the files written."""
    t0 = time.time()
    bench_dir, out_dir = bench_dir or runs_dir("bench"), out_dir or figures_dir()
    written = []
    for slug, records in collect(bench_dir).items():
        machine = machine_of(records[0][1])
        md = (f"# Benchmarks on {machine.get('gpu') or machine.get('cpu_model', slug)}\n\nMachine: {machine_line(machine)}.\n"
              f"Generated by `sprpo-bench report` from `runs/bench/*.json`; compare ratios within one run only.\n\n"
              + "## Every record in one line\n\n" + headlines(records) + "\n## Tables\n\n"
              + "\n".join(section(rec, p) for p, rec in records))
        texts = {out_dir / f"bench_{slug}.md": md,
                 out_dir / f"bench_{slug}.json": json.dumps({p.stem: rec for p, rec in records}, indent=1, default=str) + "\n"}
        if all(p.is_file() and p.read_text() == t for p, t in texts.items()):
            continue  # this machine's tables as they were: files and manifests (commit, date) left alone
        for path, text in texts.items():
            atomic_write_text(path, text)
            dtypes = sorted({str((rec.get("results") or {}).get("dtype")) for _, rec in records
                             if isinstance(rec.get("results"), dict) and (rec.get("results") or {}).get("dtype")})
            write_manifest(path, {"sources": [str(p.name) for p, _ in records]}, None, time.time() - t0,
                           extra={"machine_of_runs": machine,
                                  "dtype": dtypes or not_applicable("the records state their own dtypes"),
                                  "seeds": not_applicable("each record states its own"),
                                  "goals": not_applicable("each record states its own")})
        written += list(texts)
    machines = []
    for js_path in sorted(p for p in out_dir.glob("bench_*.json") if not p.name.endswith(".manifest.json")):
        try:
            records = [(Path(stem), rec) for stem, rec in read_json(js_path).items() if isinstance(rec, dict)]
        except (CorruptFileError, AttributeError) as err:
            log.warning("%s: skipped in the README summary (%s)", js_path, err)
            continue
        if records:
            machines.append((js_path.with_suffix(".md").name, records))
    summary = readme_block(machines) if machines else ""
    for page, prefix in [(readme, "")] if readme else doc_pages(project_root()):
        text = page.read_text() if page.is_file() else ""
        if "<!-- bench:begin -->" in text and summary:
            atomic_write_text(page, replace_block(text, "bench", "<!-- generated by sprpo-bench report; do not edit -->\n"
                                                  + summary, prefix=prefix))
    return written
