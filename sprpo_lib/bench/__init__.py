"""Benchmarks: a leaf that nothing in the library imports.

* :mod:`~sprpo_lib.bench.suite`: ``python -m sprpo_lib.bench <what>`` (``sprpo-bench``):
  perturbation hooks, environments, training iterations, the machine's roofline,
  generation engines, the held-out evaluation, prompt budgets, engine churn.
* :mod:`~sprpo_lib.bench.vllm_check`: the vLLM engine against ``HFEngine`` token for token.
"""
