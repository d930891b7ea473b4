"""Names of the per-iteration metrics of a run (``metrics.jsonl``, one JSON line per
iteration): one constant per column that is read outside the code that writes it (the
notebooks' figures and tables, the stage times, the benchmarks), so the writers
(:mod:`sprpo_lib.train.trainer`, the actor's timers, the methods' statistics) and every
reader share one spelling."""

ITERATION = "iteration"
#: Rollout: success rate, mean score and valid-action rate of every episode played.
SUCCESS = "success"
SCORE = "score"
VALID_RATE = "valid_rate"
#: Dynamic sampling: rounds played, episodes left out; whether the update had any signal.
ROLLOUT_ROUNDS = "rollout_rounds"
EPISODES_DROPPED = "episodes_dropped"
UPDATED = "updated"
SAMPLES = "samples"
PPO_STEPS = "ppo_steps"
#: Seconds per phase: rollout (of which generation and environment), the update, the
#: method's extra pass (SPrPO's replay, SAM's channel gradient), the whole iteration.
ROLLOUT_S = "rollout_s"
GENERATE_S = "generate_s"
ENV_S = "env_s"
UPDATE_S = "update_s"
SENSITIVITY_S = "sensitivity_s"
WALL_S = "wall_s"
#: What the iteration's seconds were measured on (:func:`sprpo_lib.infra.hardware.compute_class`).
MACHINE = "machine"
#: Held-out evaluation after an iteration (``eval_every``).
HELDOUT_SUCCESS = "heldout_success"
HELDOUT_S = "heldout_s"
#: The noise: the method's sigma statistics carry ``XI``, the drawn xi's ``XI_REAL``.
XI = "xi_"
XI_REAL = "xi_real_"
XI_RHO = "xi_rho"
XI_SIGMA_RMS = "xi_sigma_rms"
XI_SIGMA_MEAN = "xi_sigma_mean"
XI_SIGMA_CLAMPED_FRAC = "xi_sigma_clamped_frac"
XI_SIGMA_LAYER_RMS = "xi_sigma_layer_rms"
XI_S_K = "xi_s_k"
XI_REAL_FLIP_FRAC = "xi_real_flip_frac"
#: SPrPO's measured gradient norm m_hat (Alg. 1 line 7).
M_HAT = "m_hat"
