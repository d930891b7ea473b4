"""What this machine is good at: the faster compute dtype, measured, and a description
for manifests.

CPUs differ in which dtype their matmuls favour: with AVX512-BF16 or AMX, bfloat16
linears run faster than float32; with AVX2 only, torch's bfloat16 kernels are several
times slower.  So ``dtype: auto`` measures instead of guessing: :func:`fast_dtype` times
``F.linear`` at the model's own shapes in float32 and bfloat16 (a prefill-like batch of
tokens and a decode-like few rows) and picks the dtype with the higher throughput.  The
result is cached per machine (CPU model, instruction set torch dispatches to, torch
version, threads, shapes) in ``<cache root>/hardware/dtype-probe.json``, so the probe
costs a few seconds once.  On CUDA the answer is bfloat16 without a probe.

The probe calls ``F.linear(x, W)`` (``x @ W^T``), the call ``nn.Linear`` makes: a plain
``a @ b`` with a non-transposed bfloat16 right operand can take a much slower kernel
and would misjudge bfloat16.

:func:`prefill_flops` / :func:`decode_flops` count the work of a forward pass, so that a
benchmark can report its wall time against the floor ``flops / measured GFLOP/s``.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import platform
import time
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from sprpo_lib.infra.io import atomic_write_json
from sprpo_lib.infra.paths import cache_dir

PREFILL_ROWS = 256  # tokens in one prefill-like matmul
DECODE_ROWS = 16  # rows of one decode step (a rollout batch)
PROBE_DTYPES = ("float32", "bfloat16")
AUTO = "auto"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "neon", "sve")
_CACHE_FILE = ("hardware", "dtype-probe.json")

Shape = tuple[int, int]  # (in_features, out_features) of a linear layer


# ----------------------------------------------------------------------------- machine
def _cpuinfo() -> dict[str, str]:
    """First processor block of /proc/cpuinfo (empty off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            block = f.read().split("\n\n", 1)[0]
    except OSError:
        return {}
    out = {}
    for line in block.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            out[k.strip()] = v.strip()
    return out


def _physical_cores() -> int | None:
    """Distinct (physical id, core id) pairs in /proc/cpuinfo; None when unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            blocks = f.read().strip().split("\n\n")
    except OSError:
        return None
    cores = set()
    for b in blocks:
        d = dict((k.strip(), v.strip()) for k, v in (ln.split(":", 1) for ln in b.splitlines() if ":" in ln))
        if "core id" in d:
            cores.add((d.get("physical id", "0"), d["core id"]))
    return len(cores) or None


def cpu_model() -> str:
    """The CPU's model name (``platform.processor()`` off Linux)."""
    info = _cpuinfo()
    return info.get("model name") or info.get("Model") or platform.processor() or platform.machine()


# CPU classes, ascending: what decides the fast dtype and what OpenVINO's CPU plugin can run
# (its paged attention takes a bfloat16 KV cache only in its AVX512 kernels, bfloat16
# arithmetic only with AVX512-BF16 or AMX).
CPU_CLASSES = ("other", "avx2", "avx512", "avx512_bf16", "amx")
# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) -> the class a capped CPU stands in for
_ONEDNN_CLASS = {"SSE41": "other", "AVX": "other", "AVX2": "avx2", "AVX2_VNNI": "avx2", "AVX2_VNNI_2": "avx2",
                 "AVX512_CORE": "avx512", "AVX512_CORE_VNNI": "avx512", "AVX512_CORE_BF16": "avx512_bf16",
                 "AVX10_1_512": "avx512_bf16", "AVX512_CORE_FP16": "avx512_bf16", "AVX512_CORE_AMX": "amx",
                 "AVX512_CORE_AMX_FP16": "amx", "AVX10_1_512_AMX": "amx", "AVX10_1_512_AMX_FP16": "amx"}


def cpu_class(flags: dict[str, bool] | None = None, limits: dict[str, str] | None = None) -> str:
    """This CPU's class (:data:`CPU_CLASSES`): ``amx`` (AMX-BF16 tiles), ``avx512_bf16``,
    ``avx512`` (AVX512F without BF16), ``avx2``, ``other``.  A oneDNN ISA cap in the
    environment (``ONEDNN_MAX_CPU_ISA=AVX2``, :func:`isa_limits`) lowers it: the capped
    machine stands in for that class (an emulation: OpenVINO's own cross-compiled kernels
    still see the real CPU).  ``flags`` / ``limits`` default to this machine's."""
    if flags is None:
        present = set(_cpuinfo().get("flags", "").split())
        flags = {f: f in present for f in CPU_FLAGS}
    limits = isa_limits() if limits is None else limits
    if flags.get("amx_bf16") and flags.get("amx_tile"):
        cls = "amx"
    elif flags.get("avx512_bf16"):
        cls = "avx512_bf16"
    elif flags.get("avx512f"):
        cls = "avx512"
    elif flags.get("avx2"):
        cls = "avx2"
    else:
        cls = "other"
    cap = (limits.get("ONEDNN_MAX_CPU_ISA") or limits.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    if cap and cap not in ("ALL", "DEFAULT"):  # oneDNN's "no cap"
        capped = _ONEDNN_CLASS.get(cap)
        if capped is None:  # a value oneDNN may know and this table does not: the CPU's own class stands
            logging.getLogger(__name__).warning("ONEDNN_MAX_CPU_ISA=%s is not in this library's table of oneDNN "
                                                "ISAs (%s); the CPU class is taken from the CPU alone", cap,
                                                ", ".join(sorted(_ONEDNN_CLASS)))
        else:
            cls = min(cls, capped, key=CPU_CLASSES.index)
    return cls


def machine_info() -> dict:
    """CPU model, the instruction set torch dispatches to, flags that decide the fast
    dtype, core and thread counts and the torch version: what a manifest needs to say
    where a timing was taken."""
    cpu = _cpuinfo()
    flags = set(cpu.get("flags", cpu.get("Features", "")).split())  # x86 / ARM spelling
    info = {
        "cpu_model": cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "flags": {f: f in flags for f in CPU_FLAGS},
        "cpu_class": cpu_class({f: f in flags for f in CPU_FLAGS}),
        "physical_cores": _physical_cores(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "allocator": _allocator,
    }
    limits = isa_limits()
    if limits:
        info["isa_limits"] = limits
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def compute_class() -> str:
    """What a recorded timing ran on, in one word: the GPU's name where CUDA is in use, else the
    CPU class (:func:`cpu_class`).  Runs, evaluation cells and warm starts store it beside their
    seconds, so a staged reproduction's recorded compute says which classes it adds up."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else cpu_class()


def set_threads(n: int | None) -> int:
    """torch's intra-op threads: ``n`` (``None``: torch's own choice), never more than
    ``OMP_NUM_THREADS`` where the environment sets it.  That variable is the ceiling a user
    puts on a process sharing the machine (two jobs side by side, a parallel test run):
    OpenMP threads that outnumber the cores spin in their waits.  Returns the count in force."""
    cap = os.environ.get("OMP_NUM_THREADS", "").strip()
    if n is not None:
        torch.set_num_threads(min(n, int(cap)) if cap.isdigit() and int(cap) >= 1 else n)
    return torch.get_num_threads()


ALLOCATORS = ("tuned", "default")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_TUNED_MMAP = 32 << 20  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
_TUNED_TRIM = 1 << 30
_allocator = "default"


def set_allocator(mode: str = "tuned") -> str:
    """glibc malloc settings for the training passes; returns the state now in force.

    A pass allocates and frees activations of a few MiB each, thousands of times.  Under
    glibc's defaults the heap shrinks back to the OS whenever its free top passes the trim
    threshold, so the next pass page-faults the same memory in again: on the cpu profile's
    WebShop batch, seconds of kernel time per update and replay.
    ``"tuned"`` serves every block up to 32 MiB from the heap and keeps up to 1 GiB of
    freed memory mapped, as the tuned allocators that PyTorch's CPU performance guide
    recommends (jemalloc, tcmalloc) do, without preloading a library.  ``"default"``:
    leave glibc as it is.  Process-wide and one-way, as ``torch.set_num_threads``; results
    do not change.  Without glibc (macOS, musl) it does nothing and says so."""
    global _allocator
    if mode not in ALLOCATORS:
        raise ValueError(f"allocator={mode!r}: expected one of {ALLOCATORS} "
                         "('tuned': keep freed activation memory mapped; 'default': glibc as it is)")
    if mode == "tuned" and not _allocator.startswith("tuned"):
        try:
            libc = ctypes.CDLL("libc.so.6")
            ok = libc.mallopt(_M_MMAP_THRESHOLD, _TUNED_MMAP) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _TUNED_TRIM) == 1
            _allocator = "tuned" if ok else "default (mallopt refused the settings)"
        except (OSError, AttributeError) as err:
            _allocator = f"default (no glibc here: {err})"
    return _allocator


def keep_freed(gib: float) -> bool:
    """Under the ``tuned`` allocator, keep up to ``gib`` GiB of freed memory mapped (glibc's trim
    threshold; never lowered below the tuned 1 GiB): a pass that holds that much at once (the
    replay's kept graph, ``speed.replay_graph_gb``) then finds its pages already faulted in
    from the second iteration on.  On the cpu profile's WebShop batch the pass that kept an
    8.6 GiB graph took 2.2-2.7x its usual seconds while the heap first grew to it.  Returns
    whether the setting took; under ``default`` (or without glibc) it does nothing."""
    if _allocator != "tuned" or gib <= 0:
        return False
    try:
        return ctypes.CDLL("libc.so.6").mallopt(_M_TRIM_THRESHOLD, max(_TUNED_TRIM, int(gib * 2 ** 30))) == 1
    except (OSError, AttributeError):
        return False


def allocator() -> str:
    """The malloc state :func:`set_allocator` left (``"default"`` if never called)."""
    return _allocator


def allocator_override() -> str:
    """The config override (``allocator=...``) that keeps this process's malloc state: what a
    benchmark gives the trainer it builds, so that the trainer does not change the state the
    benchmark chose."""
    return f"allocator={'tuned' if _allocator == 'tuned' else 'default'}"


# ----------------------------------------------------------------------------- shapes and work
def linear_shapes(config) -> list[Shape]:
    """The distinct linear shapes of a Llama/Qwen2-style config: FFN up/gate
    (hidden -> FFN), FFN down (FFN -> hidden) and attention q/o (hidden -> hidden)."""
    h, f = int(config.hidden_size), int(config.intermediate_size)
    return [(h, f), (f, h), (h, h)]


def _attn_dims(config) -> tuple[int, int]:
    """(query width, key/value width) = (heads x head_dim, kv_heads x head_dim)."""
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    return heads * head_dim, kv * head_dim


def layer_params(config) -> int:
    """Weights of one decoder layer's linears: q, k, v, o and the gated FFN (gate, up,
    down); norms and biases are negligible."""
    h, f = int(config.hidden_size), int(config.intermediate_size)
    q, kv = _attn_dims(config)
    return h * q + 2 * h * kv + q * h + 3 * h * f


def prefill_flops(config, prompt_lengths: Sequence[int], lm_head: bool = True) -> float:
    """FLOPs to prefill prompts of the given token lengths, without padding.

    Per prompt of n tokens over L layers:
      ``2 * P_layer * L * n``            (every linear, 2 FLOPs per multiply-add)
    + ``2 * q_width * L * n * (n + 1)``  (causal attention: token t scores and mixes
                                          t + 1 keys, ``4 * q_width * (t + 1)`` FLOPs)
    + ``2 * hidden * vocab``             (logits of the last position only, if ``lm_head``).
    Embedding lookups, norms, activations and softmax are left out (a few percent).
    """
    L, P = int(config.num_hidden_layers), layer_params(config)
    q, _ = _attn_dims(config)
    head = 2 * int(config.hidden_size) * int(config.vocab_size) if lm_head else 0
    return float(sum(2 * P * L * n + 2 * q * L * n * (n + 1) + head for n in prompt_lengths))


def train_pass_flops(config, groups: Sequence[tuple[int, Sequence[int], Sequence[int]]], grad_layers: int,
                     forward_layers: int | None = None, head: bool = True) -> dict:
    """FLOPs of one training pass (forward through ``forward_layers`` decoder layers, all by
    default, then backward through the top ``grad_layers``; 0: a forward only) over rows
    sharing prefixes, padding left out; ``head=False``: a forward that stops below the LM head
    (the states kept under the adapters).

    ``groups``: ``(P, row_lengths, response_lengths)`` per prefix group, each row of n
    tokens computing its tokens ``P:n`` against the group's P prefix tokens (computed
    once; ``P = 0``: plain rows).  Forward: every linear on every computed token, causal
    attention (:func:`prefill_flops`' term), the LM head on each response token and the
    position before it.  Backward: the input gradient of every linear and twice the
    attention of the layers it reaches (each layer of the ``grad_layers`` top ones), and
    of the LM head; the adapters' own weight gradients (rank r << hidden) are left out,
    as are norms and activations.  Returns ``forward``, ``backward``, ``total``,
    ``computed_tokens`` and the forward's ``linear``, ``attention`` and ``head`` parts."""
    L, P_layer = int(config.num_hidden_layers), layer_params(config)
    q, _ = _attn_dims(config)
    head_w = 2 * int(config.hidden_size) * int(config.vocab_size) if head else 0
    lin = attn = logits = tokens = 0.0
    for P, lengths, responses in groups:
        tokens += P + sum(n - P for n in lengths)
        attn += 2 * q * L * (P * (P + 1) + sum(n * (n + 1) - P * (P + 1) for n in lengths))
        logits += sum(r + 1 for r in responses)
    lin = 2 * P_layer * L * tokens
    frac = min(max(int(grad_layers), 0), L) / L
    run = (L if forward_layers is None else min(max(int(forward_layers), 0), L)) / L
    fwd = run * (lin + attn) + head_w * logits  # the layers below a pass's first one are not run
    bwd = frac * (lin + 2 * attn) + (head_w * logits if grad_layers else 0.0)
    return {"forward": fwd, "backward": bwd, "total": fwd + bwd, "computed_tokens": int(tokens),
            "linear": run * lin, "attention": run * attn, "head": head_w * logits}


def decode_flops(config, context: int) -> float:
    """FLOPs to generate one token at ``context`` cached positions: every linear, the
    attention over ``context + 1`` keys and the full-vocabulary logits."""
    L, P = int(config.num_hidden_layers), layer_params(config)
    q, _ = _attn_dims(config)
    return float(2 * P * L + 4 * q * L * (context + 1) + 2 * int(config.hidden_size) * int(config.vocab_size))


def kv_bytes_per_token(config, value_bytes: int) -> int:
    """KV-cache bytes of one cached position: K and V of every KV head in every layer, at
    ``value_bytes`` per value (the cache's dtype)."""
    _, kv = _attn_dims(config)
    return 2 * int(config.num_hidden_layers) * kv * int(value_bytes)


def decode_floor_s(config, prompt_lens: Sequence[int], response_lens: Sequence[int], weight_bytes: int,
                   kv_bytes: int, bandwidth_gbs: float, gflops: float | None = None) -> float:
    """Least seconds for one batched generation call's decode steps.  At step ``s`` every
    sequence still generating (response longer than ``s``) needs its cached positions
    (prompt + ``s``) read once, with every weight, from memory: a batch of long prompts
    reads far more KV cache than weights.  With ``gflops``, a step costs at least its FLOPs
    (:func:`decode_flops` per live sequence) at that rate, whichever is slower."""
    per_token = kv_bytes_per_token(config, kv_bytes)
    total = 0.0
    for step in range(max(response_lens, default=0)):
        ctx = [p + step for p, r in zip(prompt_lens, response_lens) if r > step]
        t = (weight_bytes + per_token * sum(ctx)) / (bandwidth_gbs * 1e9)
        if gflops:
            t = max(t, sum(decode_flops(config, c) for c in ctx) / (gflops * 1e9))
        total += t
    return total


# ----------------------------------------------------------------------------- probes
def _block(x: torch.Tensor, w: torch.Tensor, reps: int) -> float:
    """Seconds for ``reps`` calls of ``F.linear(x, w)``."""
    t0 = time.perf_counter()
    for _ in range(reps):
        F.linear(x, w)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _prepare_case(rows: int, shape: Shape, dtype: torch.dtype, device: torch.device, min_s: float):
    """Operands of one probe case, warmed up (kernel choice, packing), and the number of
    calls that makes a block of about ``min_s`` seconds."""
    fan_in, fan_out = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, fan_in, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(fan_out, fan_in, generator=g) / fan_in**0.5).to(device=device, dtype=dtype)
    _block(x, w, 1)
    n, dt = 1, _block(x, w, 1)
    while dt < min_s / 4 and n < 1 << 16:
        n *= 4
        dt = _block(x, w, n)
    return x, w, max(1, int(n * min_s / max(dt, 1e-9)))


def probe_bandwidth(mbytes: int = 128, device: str | torch.device = "cpu", repeats: int = 5) -> float:
    """Memory bandwidth in GB/s: the best of ``repeats`` copies of an ``mbytes`` float32
    tensor (each copy reads and writes it: 2 x mbytes of traffic).  Decoding at small
    batch streams every weight once per step, so this bounds it."""
    device = torch.device(device)
    n = mbytes * (1 << 20) // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n * 4 / (time.perf_counter() - t0) / 1e9)
    return best


def probe_matmul(shapes: Sequence[Shape], dtypes: Sequence[str] = PROBE_DTYPES, device: str | torch.device = "cpu",
                 rows: Sequence[int] = (PREFILL_ROWS, DECODE_ROWS), min_s: float = 0.03, rounds: int = 5) -> dict:
    """Time ``F.linear`` for every rows x shape x dtype.

    Each case is timed in blocks of about ``min_s`` seconds; all cases take turns for
    ``rounds`` rounds and each keeps its best block, so a burst of load from other
    processes hits the dtypes alike and rarely hits every block of a case.

    Returns ``{dtype: {"cases": {"<rows>x<in>x<out>": GFLOP/s}, "gflops": overall,
    "gflops_by_rows": {rows: overall}}}``, where an overall rate is total FLOPs over total
    time of one call of each case (the rate of a forward pass made of these linears)."""
    device = torch.device(device)
    cases = [(r, tuple(shape), d) for r in rows for shape in shapes for d in dtypes]
    prepared = [_prepare_case(r, shape, resolve_probe_dtype(d), device, min_s) for r, shape, d in cases]
    best = [0.0] * len(cases)
    for _ in range(rounds):
        for i, ((r, shape, _), (x, w, n)) in enumerate(zip(cases, prepared)):
            best[i] = max(best[i], 2.0 * r * shape[0] * shape[1] * n / _block(x, w, n) / 1e9)
    out: dict = {d: {"cases": {}} for d in dtypes}
    for (r, shape, d), rate in zip(cases, best):
        out[d]["cases"][f"{r}x{shape[0]}x{shape[1]}"] = round(rate, 2)
    for d, v in out.items():
        v["gflops"] = _overall(v["cases"], None)
        v["gflops_by_rows"] = {str(r): _overall(v["cases"], r) for r in rows}
    return out


def _overall(cases: dict[str, float], rows: int | None) -> float:
    """Total FLOPs over total time of one call of each case (with ``rows`` rows, or all)."""
    flops = secs = 0.0
    for name, rate in cases.items():
        r, fan_in, fan_out = map(int, name.split("x"))
        if rows is None or r == rows:
            f = 2.0 * r * fan_in * fan_out
            flops, secs = flops + f, secs + f / (rate * 1e9)
    if secs == 0:
        raise ValueError(f"no probe case with {rows} rows in {sorted(cases)}")
    return round(flops / secs / 1e9, 2)


def resolve_probe_dtype(name: str) -> torch.dtype:
    if name not in PROBE_DTYPES:
        raise ValueError(f"probe dtype {name!r} is not one of {PROBE_DTYPES}")
    return getattr(torch, name)


def pick_dtype(matmul: dict) -> str:
    """The dtype with the higher overall GFLOP/s in a :func:`probe_matmul` result
    (float32 on a tie: it is the exact one)."""
    return max(PROBE_DTYPES, key=lambda d: (matmul[d]["gflops"], d == "float32"))


# ----------------------------------------------------------------------------- cached decision
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")  # env vars that cap the kernels


def isa_limits() -> dict[str, str]:
    """The environment variables set here that cap the instruction set torch's kernels
    use (e.g. ``ONEDNN_MAX_CPU_ISA=AVX2`` makes an AVX512-BF16 CPU run bfloat16 matmuls
    like an AVX2-only one): part of the probe's cache key and of :func:`machine_info`."""
    return {k: os.environ[k] for k in ISA_LIMITS if os.environ.get(k)}


def cache_key(shapes: Sequence[Shape]) -> dict:
    """What the fast dtype depends on: CPU (model name and the flags that matter: virtual
    machines may report a generic name), instruction set and any limit set on it, torch
    version, threads, shapes."""
    flags = machine_info()["flags"]
    key = {
        "cpu_model": cpu_model(),
        "cpu_flags": sorted(f for f, present in flags.items() if present),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shapes": [list(map(int, s)) for s in shapes],
    }
    limits = isa_limits()
    if limits:  # absent when unset, so keys cached before this field existed stay valid
        key["isa_limits"] = limits
    return key


def _cache_path():
    return cache_dir().joinpath(*_CACHE_FILE)


def _read_cache(path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # missing or unreadable: probe again and rewrite


def fast_dtype(shapes: Sequence[Shape], device: str | torch.device = "cpu", *, cache: bool = True,
               probe: Callable[[Sequence[Shape]], dict] | None = None) -> tuple[torch.dtype, dict]:
    """The faster of float32 and bfloat16 for linears of these shapes on ``device``.

    Returns ``(dtype, info)`` where ``info`` has the probe's numbers (``matmul``: GFLOP/s
    per dtype and case, ``bandwidth_gbs``), the ``choice``, the ``key`` it was cached under
    and ``source``: ``"probe"`` (measured now), ``"cache"`` (measured earlier on a machine
    with the same key) or ``"cuda"`` (bfloat16 on a GPU, not probed).  ``probe`` replaces
    the measurement (tests)."""
    device = torch.device(device)
    if not shapes:
        raise ValueError("fast_dtype needs at least one (in_features, out_features) shape")
    if device.type == "cuda":
        return torch.bfloat16, {"choice": "bfloat16", "source": "cuda"}
    if device.type != "cpu":
        raise ValueError(f"dtype 'auto' supports cpu and cuda devices, got {device}")
    key = cache_key(shapes)
    skey = json.dumps(key, sort_keys=True)
    path = _cache_path()
    if cache:
        hit = _read_cache(path).get(skey)
        if hit is not None:
            return getattr(torch, hit["choice"]), {**hit, "key": key, "source": "cache"}
    t0 = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    matmul = (probe or default_probe)(shapes)
    info = {"matmul": matmul["matmul"], "bandwidth_gbs": matmul.get("bandwidth_gbs"),
            "choice": pick_dtype(matmul["matmul"]), "probe_s": round(time.perf_counter() - t0, 2),
            "loadavg_1min": load,  # other processes' load at probe time (the numbers assume an idle machine)
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if cache:
        data = _read_cache(path)
        data[skey] = info
        atomic_write_json(path, data)
    return getattr(torch, info["choice"]), {**info, "key": key, "source": "probe"}


def default_probe(shapes: Sequence[Shape]) -> dict:
    """The measurement behind :func:`fast_dtype`: matmul GFLOP/s and bandwidth on the CPU."""
    return {"matmul": probe_matmul(shapes), "bandwidth_gbs": round(probe_bandwidth(), 1)}


def reset_peak_memory(device: str | torch.device = "cpu") -> None:
    """Start a phase whose peak memory :func:`peak_memory` reads: CUDA's peak counters of
    ``device``, its allocator's cache emptied first (so that the reserved peak is this
    phase's) and, on Linux, this process's peak resident set (``VmHWM``,
    reset through ``/proc/self/clear_refs``; elsewhere the peak stays the process's)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # else the reserve of earlier phases counts in this one's
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory(device: str | torch.device = "cpu") -> dict[str, float]:
    """GiB since :func:`reset_peak_memory`: ``peak_rss_gib`` (this process's peak resident
    set; an engine's worker process is not counted) and, on CUDA, ``peak_cuda_gib``
    (``torch.cuda.max_memory_allocated``) and ``peak_cuda_reserved_gib`` (what the caching
    allocator held at most: the card must hold this, fragmentation included)."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        import resource  # POSIX: the process's lifetime peak (KiB on Linux, bytes on macOS)

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kib = rss // 1024 if platform.system() == "Darwin" else rss
    out["peak_rss_gib"] = round(kib / 2**20, 3)
    dev = torch.device(device)
    if dev.type == "cuda":
        out["peak_cuda_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 3)
        out["peak_cuda_reserved_gib"] = round(torch.cuda.max_memory_reserved(dev) / 2**30, 3)
    return out


@contextlib.contextmanager
def measured_peak(device: str | torch.device, into: dict, phase: str) -> Iterator[dict]:
    """The peak memory of the ``with`` block (:func:`reset_peak_memory`, then :func:`peak_memory`),
    put into ``into`` as ``<phase>_<key>``."""
    reset_peak_memory(device)
    yield into
    into.update({f"{phase}_{k}": v for k, v in peak_memory(device).items()})
