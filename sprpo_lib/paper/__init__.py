"""The paper's experiments, figures, tables and theory checks: what each numbered notebook
computes (cached apart from its rendering) and draws.

* :mod:`~sprpo_lib.paper.experiments`: the plans per profile (policies, settings, tasks,
  seeds) and the cached computations of notebooks 03-07;
* :mod:`~sprpo_lib.paper.results`, :mod:`~sprpo_lib.paper.tables`, :mod:`~sprpo_lib.paper.stats`:
  figures, LaTeX/CSV tables in the paper's layouts, paired statistics;
* :mod:`~sprpo_lib.paper.report`: training runs as tables and curves (notebook 01);
* :mod:`~sprpo_lib.paper.theory`: Lemma 1, Theorem 1, Corollary 1, Theorem 2 on exact MDPs (notebook 02);
* :mod:`~sprpo_lib.paper.quickstart`: the perturbation demo (notebook 00);
* :mod:`~sprpo_lib.paper.notebook`: the steps every results notebook repeats.
"""
