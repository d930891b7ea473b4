"""sprpo: companion library of "Learning Perturbation Robust Policies for LLM Agents
with Stable Optimization" (SPrPO).

Layers, bottom first; each imports only its own layer and the ones below it
(``tests/test_layout.py`` checks this, and that no import cycle exists):

1. ``io``, ``paths``, ``registry``, ``progress``, ``hardware``, ``manifest``, ``executor``,
   ``tracking``: files written whole and read back checked, where things live,
   registries, machine facts, provenance, where runs and cells execute (local or Ray),
   where training metrics go (JSON lines, console, TensorBoard, W&B);
2. ``models``, ``perturb``, ``compress``, ``agent``, ``envs/``: policies, FFN-channel
   perturbations, the deployment perturbations of App. C, prompts, environments;
3. ``engines/``: generation back ends behind one interface (``hf``, ``openvino``, ``vllm``);
4. ``rollout``: episodes played in groups;
5. ``advantages``, ``losses``, ``batch``, ``actor``, ``methods``: the algorithm (Algs. 1-4);
6. ``config``, ``checkpoint``, ``sft``, ``heldout``, ``train``: training runs;
7. ``evaluate/``: robustness evaluation of any agent (App. C);
8. ``paper/``: the paper's experiments, figures, tables and theory checks;
9. ``reproduce``: the numbered notebooks, run headlessly;
10. ``bench/``: benchmarks, a leaf nothing imports.
"""
__version__ = "0.1.0"
