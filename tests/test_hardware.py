"""dtype 'auto': the matmul probe, its per-machine cache, the decision, and the FLOP counts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from sprpo_lib.infra import hardware
from sprpo_lib.model.load import load_policy, resolve_dtype

#: What every manifest states (infra.manifest.DESIGN_KEYS).
DESIGN = {"dtype": "float32", "seeds": {"eval": [0]}, "goals": {"table": 2}}

SHAPES = [(64, 128), (128, 64), (64, 64)]


@pytest.fixture(autouse=True)
def _cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("SPRPO_CACHE", str(tmp_path / "cache"))


def _fake_probe(fp32: float, bf16: float, calls: list):
    def probe(shapes):
        calls.append(list(shapes))
        return {"matmul": {"float32": {"cases": {}, "gflops": fp32}, "bfloat16": {"cases": {}, "gflops": bf16}},
                "bandwidth_gbs": 10.0}

    return probe


def test_real_probe_measures_both_dtypes_and_picks_one():
    dtype, info = hardware.fast_dtype(SHAPES)
    assert dtype in (torch.float32, torch.bfloat16)
    assert info["source"] == "probe" and info["choice"] == str(dtype).replace("torch.", "")
    for d in ("float32", "bfloat16"):
        cases = info["matmul"][d]["cases"]
        assert len(cases) == 2 * len(SHAPES)  # prefill-like and decode-like rows
        assert all(v > 0 for v in cases.values()) and info["matmul"][d]["gflops"] > 0
    assert info["bandwidth_gbs"] > 0
    assert dtype == getattr(torch, hardware.pick_dtype(info["matmul"]))


def test_cache_hit_returns_the_same_numbers_without_probing(monkeypatch, tmp_path):
    for var in hardware.ISA_LIMITS:  # uncapped to begin with, also where the caller's shell caps the kernels
        monkeypatch.delenv(var, raising=False)
    calls: list = []
    monkeypatch.setattr(hardware, "default_probe", _fake_probe(100.0, 300.0, calls))
    d1, i1 = hardware.fast_dtype(SHAPES)
    d2, i2 = hardware.fast_dtype(SHAPES)
    assert len(calls) == 1 and d1 == d2 == torch.bfloat16
    assert (i1["source"], i2["source"]) == ("probe", "cache")
    assert i1["matmul"] == i2["matmul"] and i1["key"] == i2["key"]
    path = tmp_path / "cache" / "hardware" / "dtype-probe.json"
    assert json.loads(path.read_text())  # written where paths.cache_dir() points
    hardware.fast_dtype(SHAPES[:2])  # other shapes: another key, another probe
    assert len(calls) == 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads != 1 else 2)
        hardware.fast_dtype(SHAPES)  # thread count is part of the key
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 3
    hardware.fast_dtype(SHAPES, cache=False)
    assert len(calls) == 4
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # an instruction-set cap: another key, another probe
    d5, i5 = hardware.fast_dtype(SHAPES)
    assert len(calls) == 5 and i5["key"]["isa_limits"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert hardware.machine_info()["isa_limits"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert hardware.fast_dtype(SHAPES)[1]["source"] == "cache" and len(calls) == 5


def test_decision_follows_the_larger_throughput(monkeypatch):
    calls: list = []
    monkeypatch.setattr(hardware, "default_probe", _fake_probe(120.0, 15.0, calls))
    assert hardware.fast_dtype(SHAPES, cache=False)[0] == torch.float32
    monkeypatch.setattr(hardware, "default_probe", _fake_probe(120.0, 400.0, calls))
    assert hardware.fast_dtype(SHAPES, cache=False)[0] == torch.bfloat16
    assert hardware.pick_dtype({"float32": {"gflops": 5.0}, "bfloat16": {"gflops": 5.0}}) == "float32"


def test_cuda_is_bfloat16_without_probe(monkeypatch):
    calls: list = []
    monkeypatch.setattr(hardware, "default_probe", _fake_probe(1.0, 1.0, calls))
    dtype, info = hardware.fast_dtype(SHAPES, "cuda")
    assert dtype == torch.bfloat16 and info["source"] == "cuda" and not calls


def test_bad_dtype_strings_give_one_clear_error():
    with pytest.raises(ValueError, match=r"dtype='bf16' is not supported; expected one of .*'auto'.*'bfloat16'"):
        resolve_dtype("bf16")
    with pytest.raises(ValueError, match="expected one of"):
        load_policy("tiny-qwen2", dtype="fp32")
    with pytest.raises(ValueError, match="at least one"):
        hardware.fast_dtype([])


def test_tiny_auto_is_float32_and_real_auto_is_probed(monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setattr(hardware, "default_probe", _fake_probe(10.0, 20.0, calls))
    assert load_policy("tiny-qwen2").dtype == torch.float32 and not calls
    src = load_policy("tiny-llama", seed=1)
    src.model.save_pretrained(tmp_path / "m")
    src.tokenizer.save_pretrained(tmp_path / "m")
    pol = load_policy(str(tmp_path / "m"))  # a real model directory: dtype auto
    cfg = pol.model.config
    assert calls == [[(64, 128), (128, 64), (64, 64)]] == [hardware.linear_shapes(cfg)]
    assert pol.dtype == torch.bfloat16 and pol.meta["dtype"] == "bfloat16"
    assert pol.meta["dtype_probe"]["matmul"]["bfloat16"]["gflops"] == 20.0
    assert load_policy(str(tmp_path / "m"), dtype="float32").dtype == torch.float32 and len(calls) == 1


def test_flop_counts_match_the_formula():
    smol = types.SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)
    per_layer = 576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536
    assert hardware.layer_params(smol) == per_layer
    n = 500
    expect = 2 * per_layer * 30 * n + 2 * 576 * 30 * n * (n + 1)
    assert hardware.prefill_flops(smol, [n], lm_head=False) == expect
    assert hardware.prefill_flops(smol, [n, n]) == 2 * (expect + 2 * 576 * 49152)
    assert 0.2e9 < expect / n < 0.26e9  # about 0.23 GFLOP per prompt token
    assert hardware.decode_flops(smol, 0) == 2 * per_layer * 30 + 4 * 576 * 30 + 2 * 576 * 49152


def test_machine_info_names_the_cpu_and_flags():
    info = hardware.machine_info()
    assert info["capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(info["flags"]) >= {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    assert info["torch"] == torch.__version__ and info["cpu_model"]


NO_FLAGS = {f: False for f in hardware.CPU_FLAGS}


@pytest.mark.parametrize("flags, cls", [
    ({}, "other"),
    ({"avx2": True}, "avx2"),  # e.g. Zen 3
    ({"avx2": True, "avx512f": True}, "avx512"),  # e.g. Skylake-X, Ice Lake
    ({"avx2": True, "avx512f": True, "avx512_bf16": True}, "avx512_bf16"),  # e.g. Zen 4, Cooper Lake
    ({"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": True, "amx_tile": True}, "amx"),  # Sapphire Rapids
])
def test_cpu_class_from_flags_and_caps(flags, cls):
    f = {**NO_FLAGS, **flags}
    assert hardware.cpu_class(f, {}) == cls
    # a oneDNN cap stands in for a lower class, never a higher one
    assert hardware.cpu_class(f, {"ONEDNN_MAX_CPU_ISA": "AVX2"}) == min(cls, "avx2", key=hardware.CPU_CLASSES.index)
    assert hardware.cpu_class(f, {"DNNL_MAX_CPU_ISA": "avx512_core"}) == min(cls, "avx512",
                                                                              key=hardware.CPU_CLASSES.index)
    assert hardware.cpu_class(f, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}) == cls
    assert hardware.cpu_class(f, {"ONEDNN_MAX_CPU_ISA": "ALL"}) == cls  # oneDNN's "no cap"
    assert hardware.cpu_class(f, {"ONEDNN_MAX_CPU_ISA": "AVX9"}) == cls  # unknown to the table: a warning, no cap


def test_machine_info_and_manifests_record_the_cpu_class(tmp_path, monkeypatch):
    from sprpo_lib.infra.manifest import write_manifest

    for name in hardware.ISA_LIMITS:  # the test sets its own cap (a suite run under an emulated class has one)
        monkeypatch.delenv(name, raising=False)
    assert hardware.machine_info()["cpu_class"] == hardware.cpu_class() in hardware.CPU_CLASSES
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert hardware.machine_info()["cpu_class"] in ("avx2", "other")
    m = json.loads(write_manifest(tmp_path / "fig.png", {}, 0, 1.0, DESIGN).read_text())
    assert m["host"]["cpu_class"] == hardware.cpu_class() and m["host"]["isa_limits"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_peak_memory_per_phase_sees_an_allocation_and_resets():
    """A 300 MB buffer touched inside a phase raises that phase's peak RSS by about its
    size; the next phase, started after it is freed, does not see it (Linux resets the
    peak through /proc/self/clear_refs)."""
    from sprpo_lib.infra.hardware import peak_memory, reset_peak_memory

    reset_peak_memory()
    base = peak_memory()["peak_rss_gib"]
    buf = bytearray(300 * 2**20)
    buf[::4096] = b"\x01" * len(buf[::4096])  # touch every page
    with_buf = peak_memory()["peak_rss_gib"]
    assert with_buf - base > 0.25
    del buf
    reset_peak_memory()
    if os.path.exists("/proc/self/clear_refs"):
        assert peak_memory()["peak_rss_gib"] < with_buf - 0.2


_CHURN = """
import resource, sys, torch
from sprpo_lib.infra import hardware
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def churn():  # a pass's pattern: activations of 1-16 MiB of many sizes, alive together, written, all freed
    for r in range(10):
        keep = [torch.ones((1 + (7 * i + r) % 16) << 18) for i in range(24)]
        del keep
churn()
f0 = faults(); churn(); default = faults() - f0
state = hardware.set_allocator("tuned")
churn()
f0 = faults(); churn(); tuned = faults() - f0
print(state, default, tuned)
"""


def test_tuned_allocator_stops_the_page_faults_of_freed_activations():
    """glibc's defaults give freed activation memory back to the OS (or map it fresh) and fault
    it in again on the next pass; tuned, the same allocation pattern runs with almost no page
    faults (a fresh process: the setting is one-way).  The rounds write 1.9 GiB (490,000 pages
    of 4 KiB); how much of it the default refaults depends on the heap's layout (25,000 to all
    of it in repeated runs here, and now and then none)."""
    runs = []
    for _ in range(5):  # fresh processes until the default side refaults (it does in ~5 of 6 here)
        out = subprocess.run([sys.executable, "-c", _CHURN], capture_output=True, text=True, check=True).stdout.split()
        if out[0] != "tuned":
            pytest.skip(f"no glibc mallopt here: {' '.join(out[:-2])}")
        runs.append((int(out[-2]), int(out[-1])))
        if runs[-1][0] > 10_000:
            break
    assert max(d for d, _ in runs) > 10_000, runs
    assert all(t < 2_000 for _, t in runs), runs  # under 0.5% of the pages written


def test_allocator_rejects_unknown_modes_in_one_clear_error():
    with pytest.raises(ValueError, match=r"allocator='jemalloc': expected one of \('tuned', 'default'\)"):
        hardware.set_allocator("jemalloc")
    from sprpo_lib.train.config import load_config

    with pytest.raises(ValueError, match="allocator='fast'"):
        load_config("smoke", ["allocator=fast"])
    assert hardware.allocator_override() in ("allocator=tuned", "allocator=default")


def test_threads_follow_the_setting_under_the_ceiling_the_environment_puts(monkeypatch):
    """set_threads: the requested count where OMP_NUM_THREADS is unset or higher, the
    variable's count where it is lower; None leaves torch's count as it is."""
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert hardware.set_threads(2) == 2 == torch.get_num_threads()
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert hardware.set_threads(2) == 1 == torch.get_num_threads()
        assert hardware.set_threads(None) == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        assert hardware.set_threads(3) == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "")  # set but empty: no ceiling
        assert hardware.set_threads(2) == 2
    finally:
        torch.set_num_threads(before)
