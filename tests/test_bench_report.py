"""The bench report (``sprpo-bench report``): one file per machine, the README's overview
block, and each record's one-line headline."""
from __future__ import annotations

import json
from pathlib import Path

from sprpo_lib.bench.report import headline


def test_generate_headline_says_when_the_wall_is_the_prefill_alone():
    row = {"wall_over_prefill_floor": 1.03, "wall_s": 10.8}
    rec = {"bench": "generate", "results": {"new_tokens": 1, "prefix_caching": False,
                                            "float32": {"T0": {"openvino": row}}}}
    assert headline(rec) == "`openvino:float32` T=0 1.03x its prefill floor (one new token, no prefix cache: the prefill alone)"
    rec["results"]["new_tokens"] = 48
    assert headline(rec) == "`openvino:float32` T=0 1.03x its prefill floor"


def test_bench_report_writes_one_file_per_machine_and_the_readme_block(tmp_path):
    from sprpo_lib.bench.report import report

    bench, out = tmp_path / "bench", tmp_path / "figures"
    bench.mkdir()
    amx = {"cpu_model": "Intel(R) Xeon(R) Processor", "cpu_class": "amx", "capability": "AVX512"}
    zen = {"cpu_model": "AMD EPYC", "cpu_class": "avx512_bf16"}
    churn = {"builds": 1000, "calls": 2000, "hangs": 0, "retries": 0, "wall_s": 495.6, "machine": amx}
    ev = {"machine": amx, "openvino": {"engine": "openvino", "dtype": "bfloat16",
                                       "eval": {"wall_s": 57.8, "episodes": 64, "episodes_per_min": 66.4,
                                                "wall_over_prefill_floor": 1.13, "success": 0.2188}}}
    for name, rec in {"churn": {"bench": "churn", "results": churn, "date": "2026-11-25T16:00:00Z", "wall_s": 497.9},
                      "eval": {"bench": "eval", "results": ev, "date": "2026-11-25T17:00:00Z", "wall_s": 300},
                      "machine": {"bench": "machine", "date": "2026-11-24", "wall_s": 60,
                                  "results": {"machine": zen, "prefill_gflops": {"bfloat16": 739.2}}},
                      "train_mb16": {"bench": "train", "date": "2026-11-29", "wall_s": 300, "results": {
                          "machine": amx, "env": "webshop", "profile": "cpu", "overrides": ["update.micro_batch=16"],
                          "shared": {"vanilla": {"update_s": 25.19, "update_over_floor": 7.37, "update_s_per_sample": 0.514,
                                                 "iteration_s": 36.97},
                                     "sprpo_over_vanilla": 2.0}}}}.items():
        (bench / f"{name}.json").write_text(json.dumps(rec))
    (bench / "torn.json").write_text('{"bench": "eval", "res')  # a killed writer's file is skipped, not fatal
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench:begin -->\nold\n<!-- bench:end -->\nrest\n")
    written = report(bench, out, readme)
    assert sorted(p.name for p in written) == ["bench_amd-epyc-avx512-bf16.json", "bench_amd-epyc-avx512-bf16.md",
                                               "bench_intel-xeon-processor-amx.json", "bench_intel-xeon-processor-amx.md"]
    md = (out / "bench_intel-xeon-processor-amx.md").read_text()
    assert "| 1000 | 2000 | 0 | 0 |" in md and "66.4" in md and "1.13x" in md
    assert (out / "bench_intel-xeon-processor-amx.md.manifest.json").is_file()
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("rest\n")
    assert "[Intel(R) Xeon(R) Processor (class amx)](figures/bench_intel-xeon-processor-amx.md)" in text
    # every record's headline opens its machine's page, above the tables
    assert md.index("0 hangs and 0 retries in 1000 engine builds") < md.index("## Tables") and "66.4 held-out episodes/min" in md
    assert "bfloat16 739.2 GFLOP/s prefill matmul" in (out / "bench_amd-epyc-avx512-bf16.md").read_text()
    # a record measured under config overrides says so, in its table's heading and in its headline
    assert "webshop `cpu` batch (update.micro_batch=16):" in md
    assert "webshop (update.micro_batch=16) update 25.19 s (7.37x its floor); iteration x Vanilla: SPrPO 2.0" in md
    # a second report over the same records leaves every machine's files and manifests alone;
    # a changed record rewrites that machine's alone
    manifest = out / "bench_amd-epyc-avx512-bf16.md.manifest.json"
    manifest.write_text(manifest.read_text().replace('"date"', '"date_was"'))
    assert report(bench, out, readme) == [] and '"date_was"' in manifest.read_text()
    (bench / "churn.json").write_text(json.dumps({"bench": "churn", "date": "2026-11-26", "wall_s": 9.0,
                                                  "results": {**churn, "hangs": 1}}))
    assert [p.name for p in report(bench, out, readme)] == ["bench_intel-xeon-processor-amx.md",
                                                            "bench_intel-xeon-processor-amx.json"]
    assert "| 1000 | 2000 | 1 | 0 |" in (out / "bench_intel-xeon-processor-amx.md").read_text()
    assert '"date_was"' in manifest.read_text()


def test_bench_readme_overview_reads_each_environments_main_records(tmp_path):
    """The README's overview row per environment reads ``train_<env>`` or ``train`` run on it (never a
    variant under config overrides), ``ops_<env>`` and ``eval_<env>``; SAM's ratio from the newest run
    that timed it; "-" where nothing was measured; every record still listed in its machine's fold."""
    from sprpo_lib.bench.report import OVERVIEW_HEADER, readme_block

    amx = {"cpu_model": "Xeon", "cpu_class": "amx"}

    def train(env, upd, date, overrides=(), sam=None):
        sh = {"vanilla": {"update_s": 20.0, "update_over_floor": upd, "update_s_per_sample": 0.4, "ppo_steps": 4.0},
              "sprpo_over_vanilla": 2.0, "sprpo_over_vanilla_at_floors": 1.5}
        if sam:
            sh.update(sam_over_vanilla=sam, sam_over_vanilla_at_floors=3.0)
        return {"bench": "train", "date": date, "results": {
            "machine": amx, "env": env, "dtype": "bfloat16", "overrides": list(overrides), "shared": sh,
            "whole": {"vanilla": {"update_s": 40.0, "update_s_per_sample": 0.8, "ppo_steps": 4.0}}}}

    ev = {"bench": "eval", "date": "2026-12-02", "results": {"machine": amx, "env": "webshop", "openvino:auto": {"eval": {
        "episodes_per_min": 90.0, "wall_over_prefill_floor": 1.85, "least_over_prefill_floor": 1.03}}}}
    ops = {"bench": "ops", "date": "2026-12-02", "results": {"machine": amx, "env": "webshop", "eager_bound_over_floor": 1.78}}
    records = [(Path("train"), train("webshop", 5.87, "2026-12-01")),
               (Path("train_mb16_webshop"), train("webshop", 7.0, "2026-12-03", ["update.micro_batch=16"], sam=9.9)),
               (Path("train_sam_webshop"), train("webshop", 6.1, "2026-11-30", sam=2.456)),
               (Path("train_alfworld"), train("alfworld", 5.6, "2026-12-02")),
               (Path("ops_webshop"), ops), (Path("eval_webshop"), ev),
               (Path("ops_sprpo_alfworld"), {**ops, "results": {**ops["results"], "env": "alfworld", "method": "sprpo"}})]
    block = readme_block([("bench_xeon-amx.md", records)])
    assert block.startswith(OVERVIEW_HEADER)
    assert ("| Xeon (amx) | webshop | 5.87x (eager bound 1.78x) | 0.4 / 0.8 s = 0.500x | 2.0 (1.5) | 2.456 (3.0) "
            "| 1.85x (least 1.03x), `openvino:auto` | bfloat16 |") in block
    assert "| Xeon (amx) | alfworld | 5.6x | 0.4 / 0.8 s = 0.500x | 2.0 (1.5) | - | - | bfloat16 |" in block
    assert "[Xeon (class amx)](figures/bench_xeon-amx.md)" in block
    from sprpo_lib.bench.report import headlines

    assert "- `train_mb16_webshop`: webshop (update.micro_batch=16) update 20.0 s (7.0x its floor)" in headlines(records)
    # SPrPO's ops record is not ALFWorld's eager bound (Vanilla's); a machine with no train, ops or eval record has no row, and a GPU machine none at all
    gpu = [(Path("gpu_h200"), {"bench": "gpu", "results": {"machine": {"gpu": "H200", "cpu_class": "amx"}}})]
    assert OVERVIEW_HEADER not in readme_block([("bench_h200.md", gpu)])
