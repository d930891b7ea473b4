"""Training runs: the config, checkpoints, and the RL loop of Alg. 1 (``python -m sprpo_lib.train``)."""
