"""Benchmarks: a leaf that nothing in the library imports.

* :mod:`~sprpo_lib.bench.cli`: ``python -m sprpo_lib.bench <what>`` (``sprpo-bench``);
* :mod:`~sprpo_lib.bench.suite`: perturbation hooks, environments, training iterations, the
  machine's roofline, generation engines, the held-out evaluation, prompt budgets, engine churn;
* :mod:`~sprpo_lib.bench.gpu`: the ``paper`` profile on one GPU (``sprpo-bench gpu``);
* :mod:`~sprpo_lib.bench.report`: the records as ``figures/bench_<machine>.md`` and the README block;
* :mod:`~sprpo_lib.bench.vllm_check`: the vLLM engine against ``HFEngine`` token for token.
"""
