"""Policy loading (issue 2, item 2)."""
from __future__ import annotations

import pytest
import torch

from sprpo_lib.model.layers import decoder_layers, ffn_modules
from sprpo_lib.model.load import build_tiny, load_policy, smollm2_gguf_path
from sprpo_lib.model.lora import LoraSettings, add_lora, merge_lora


def test_tiny_models_are_seeded_and_have_gated_ffn(tiny_spec):
    a = load_policy(tiny_spec, seed=3)
    b = load_policy(tiny_spec, seed=3)
    c = load_policy(tiny_spec, seed=4)
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    mlps = ffn_modules(a.model)
    assert len(mlps) == len(decoder_layers(a.model)) == 2
    assert all(not p.requires_grad for p in a.model.parameters())
    # the gated FFN is h = SiLU(gate x) * up x, y = down h (Sec. 5)
    mlp = mlps[0]
    x = torch.randn(3, mlp.gate_proj.in_features)
    h = torch.nn.functional.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)
    torch.testing.assert_close(mlp(x), h @ mlp.down_proj.weight.T, rtol=1e-5, atol=1e-6)


def test_tiny_tokenizer_is_lossless_and_has_chat_template():
    _, tok = build_tiny("tiny-qwen2")
    text = "Task: put a clean mug in coffeemachine 1 — café <action>go to desk 1</action>"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_lora_wraps_all_projections_and_starts_at_identity(tiny):
    ids = torch.randint(3, 250, (2, 11))
    base = tiny.model(ids).logits
    add_lora(tiny, LoraSettings(rank=4, alpha=8))
    names = [n for n, _ in tiny.model.named_modules() if n.endswith("lora_A")]
    kinds = {n.split(".")[-2] for n in names}
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    trainable = [n for n, p in tiny.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    torch.testing.assert_close(tiny.model(ids).logits, base)
    assert len(ffn_modules(tiny.model)) == 2
    merge_lora(tiny)
    assert not any("lora" in n for n, _ in tiny.model.named_modules())
    torch.testing.assert_close(tiny.model(ids).logits, base)


def test_lora_on_last_layers_stops_backprop_there(tiny):
    from sprpo_lib.model.layers import decoder_layers
    from sprpo_lib.model.lora import lora_on_last_layers

    settings = lora_on_last_layers(tiny.model, LoraSettings(rank=4, alpha=8), 1)
    assert all(n.startswith("model.layers.1.") for n in settings.targets) and len(settings.targets) == 7
    add_lora(tiny, settings)
    layers = list(decoder_layers(tiny.model))
    assert not any("lora_" in n for n, _ in layers[0].named_modules())
    assert any("lora_" in n for n, _ in layers[1].named_modules())
    ids = torch.randint(3, 250, (2, 9))
    tiny.model(ids).logits.float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in tiny.model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    assert lora_on_last_layers(tiny.model, LoraSettings(), None) == LoraSettings()
    with pytest.raises(ValueError, match=r"lora_layers=5: expected 1\.\.2"):
        lora_on_last_layers(tiny.model, LoraSettings(), 5)


def test_bad_specs_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="neither a known name"):
        load_policy("not a model")
    with pytest.raises(ValueError, match="dtype"):
        load_policy("tiny-qwen2", dtype="int3")
    with pytest.raises(ValueError, match=r"rank=0: out of range; expected an integer >= 1"):
        add_lora(load_policy("tiny-qwen2"), LoraSettings(rank=0))


def test_local_directory_roundtrip(tmp_path):
    """A saved HF directory loads through the same path as Qwen2.5-1.5B-Instruct would."""
    pol = load_policy("tiny-qwen2", seed=1)
    pol.model.save_pretrained(tmp_path, safe_serialization=True)
    pol.tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    again = load_policy(str(tmp_path), dtype="float32")
    ids = torch.randint(3, 250, (1, 9))
    torch.testing.assert_close(again.model(ids).logits, pol.model(ids).logits)
    assert again.tokenizer.padding_side == "left"


def test_training_and_evaluation_resolve_a_model_the_same_way(tmp_path):
    """resolve_model is the one place a spec becomes weights folder, dtype and device: the
    tiny models have no folder and load in float32; a local directory is its own folder;
    the evaluation's cache key names the dtype load_policy then uses."""
    from sprpo_lib.evaluate import EvalConfig
    from sprpo_lib.evaluate.sweep import ModelSource
    from sprpo_lib.model.load import resolve_model

    tiny = resolve_model("tiny-qwen2", device="cpu")
    assert (tiny.path, tiny.dtype, tiny.device.type) == (None, torch.float32, "cpu")
    pol = load_policy("tiny-qwen2", seed=1)
    pol.model.save_pretrained(tmp_path, safe_serialization=True)
    pol.tokenizer.save_pretrained(tmp_path)
    local = resolve_model(str(tmp_path), "bfloat16", "cpu")
    assert local.path == tmp_path and local.dtype == torch.bfloat16
    src = ModelSource(EvalConfig(model=str(tmp_path), dtype="bfloat16", device="cpu"))
    assert src.identity()["dtype"] == "bfloat16" == load_policy(str(tmp_path), dtype="bfloat16").meta["dtype"]
    with pytest.raises(ValueError, match="neither a known name"):
        resolve_model("not a model")


@pytest.mark.slow
def test_embedded_default_model_loads_from_cache():
    pytest.importorskip("gguf")
    try:
        smollm2_gguf_path()
    except FileNotFoundError as err:
        pytest.fail(str(err))
    pol = load_policy("smollm2-135m")
    cfg = pol.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    # dtype "auto": the faster of float32 / bfloat16 measured on this machine
    assert pol.meta["dtype"] == pol.meta["dtype_probe"]["choice"] in ("float32", "bfloat16")
    assert pol.dtype == getattr(torch, pol.meta["dtype"])
    ids = pol.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    out = pol.model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=pol.tokenizer.pad_token_id)
    text = pol.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in text


def test_device_resolution_and_errors():
    from sprpo_lib.model.load import resolve_device

    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'tpu0' is not a torch device"):
        resolve_device("tpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA GPU here"):
            resolve_device("cuda:1")


def test_saved_adapters_are_the_same_bytes_in_every_process(tmp_path):
    """peft writes target_modules in the process's hash order; save_peft does not, so
    identical runs in two processes (e.g. Ray workers) give identical adapter files."""
    import os
    import subprocess
    import sys

    code = ("import sys; from sprpo_lib.model.load import load_policy; "
            "from sprpo_lib.model.lora import add_lora, save_peft; "
            "p = add_lora(load_policy('tiny-qwen2', seed=0)); save_peft(p.model, sys.argv[1])")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / seed)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env={**os.environ, "PYTHONHASHSEED": seed})
             for seed in ("1", "2", "3")]  # side by side: three processes' imports, not one after another
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [out[-2000:] for p, out in zip(procs, outs) if p.returncode != 0] == []
    assert len({(tmp_path / seed / "adapter_config.json").read_bytes() for seed in ("1", "2", "3")}) == 1


def test_the_paper_shape_stand_in_follows_the_hardware_dtype_rule(monkeypatch):
    """random-qwen2.5-1.5b exists to measure the paper's shape, so dtype auto asks the
    machine (bfloat16 where it is faster, e.g. on CUDA) like a real model, with the probe in
    meta; the tiny test models stay float32 (exact tests).  The probe is stubbed to answer
    bfloat16 and record the shapes it was asked about."""
    import sprpo_lib.model.load as load_mod
    from sprpo_lib.model.load import TinyConfig

    asked = []

    def fake_fast_dtype(shapes, device):
        asked.append(list(shapes))
        return torch.bfloat16, {"chosen": "bfloat16"}

    monkeypatch.setattr(load_mod, "fast_dtype", fake_fast_dtype)  # where load_policy looks it up
    small = TinyConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    big = load_policy("random-qwen2.5-1.5b", tiny=small)
    assert big.dtype == torch.bfloat16 and big.meta["dtype_probe"] == {"chosen": "bfloat16"}
    assert asked == [[(32, 64), (64, 32), (32, 32)]]  # the model's own linear shapes
    assert load_policy("tiny-qwen2", tiny=small).dtype == torch.float32 and len(asked) == 1
    assert load_policy("random-qwen2.5-1.5b", dtype="float32", tiny=small).dtype == torch.float32


def test_lm_head_receives_row_major_input_and_computes_the_same_logits(tiny_spec):
    """transformers slices the last hidden states before the head (``logits_to_keep``); on CPU
    such a slice makes ``F.linear`` expand and copy the whole head weight per call.  A loaded
    policy's head sees a row-major copy instead: the strides it receives, and logits and
    gradients equal to those of the same model without the hook, in float32."""
    from sprpo_lib.model.layers import dense_head_input, row_major_strides

    pol = load_policy(tiny_spec, seed=1)
    plain, _ = build_tiny(tiny_spec, seed=1)  # the same weights, no hook
    plain.eval()
    seen: list[tuple] = []
    for model in (pol.model, plain):
        model.get_output_embeddings().register_forward_pre_hook(
            lambda m, args: seen.append((args[0].shape, args[0].stride())))
    ids = torch.randint(3, 250, (3, 13))
    got = []
    for model in (pol.model, plain):
        emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        for keep in (1, 4):  # a prefix pass / prefill (the last position), a response window
            out = model(inputs_embeds=emb, logits_to_keep=keep).logits
            (g,) = torch.autograd.grad(out.pow(2).mean(), emb)
            got.append((out.detach(), g))
    hooked, bare = seen[:2], seen[2:]
    assert all(stride == row_major_strides(shape) for shape, stride in hooked)
    assert any(stride != row_major_strides(shape) for shape, stride in bare)  # what transformers passes
    for (a, ga), (b, gb) in zip(got[:2], got[2:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-9)
    dense_head_input(pol.model)  # idempotent: still one hook of ours beside the recorder
    assert len(pol.model.get_output_embeddings()._forward_pre_hooks) == 2
