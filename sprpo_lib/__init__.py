"""sprpo: companion library of "Learning Perturbation Robust Policies for LLM Agents
with Stable Optimization" (SPrPO).

Layers, bottom first, one folder each; a module imports only its own layer and the ones
below it (``tests/test_layout.py`` checks this, and that no import cycle exists):

1. ``infra/``: files written whole and read back checked, where things live, registries,
   progress, machine facts, provenance, where runs and cells execute (local or Ray), where
   training metrics go (JSON lines, console, TensorBoard, W&B);
2. ``model/``: the policy model (embedded default, local or hub checkpoints, tiny test
   models), its layers, LoRA adapters and their files;
3. ``core/``: the algorithm on explicit tensors (Algs. 1-4: advantages, losses, batch, actor,
   methods), the FFN-channel perturbation and the deployment perturbations of App. C;
4. ``agent/``: prompts and actions, generation engines (``hf``, ``openvino``, ``vllm``),
   environments, episodes played in groups;
5. ``warmstart/``: demonstrations, behaviour cloning with DAgger, its cache, its held-out
   evaluation;
6. ``train/``: the training config, checkpoints, the RL loop of Alg. 1;
7. ``evaluate/``: robustness evaluation of any agent (App. C);
8. ``paper/``: the paper's experiments, figures, tables and theory checks;
9. ``reproduce``: the numbered notebooks, run headlessly;
10. ``bench/``: benchmarks, a leaf nothing imports.
"""
__version__ = "0.1.0"
