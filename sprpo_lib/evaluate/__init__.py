"""Evaluation of LLM agents under deployment perturbations (App. C, Table 1, Fig. 3).

:func:`evaluate` plays any Hugging Face causal LM agent (a local directory, a hub id
  in the local cache, the embedded default or a tiny test model, plus peft adapters
  merged in order) on the held-out tasks of App. C under one perturbation family
  (:data:`sprpo_lib.core.compress.PERTURBATIONS`) at several strengths and evaluation seeds,
  and returns tidy rows, one per episode.  Every cell (model x env x family x strength
  x seed) is stored atomically in a content-keyed cache, so a sweep computes only
  missing cells and a killed sweep resumes.  ``sprpo-eval`` (``python -m sprpo_lib.evaluate``) is
  its command line.  The held-out evaluation during training is :mod:`sprpo_lib.warmstart.heldout`.

App. C protocol, as implemented here:

* held-out tasks: WebShop's 500 test goals (split ``test``), ALFWorld's official
  validation games, 140 ``valid_seen`` (ID) and 134 ``valid_unseen`` (OOD); ``tasks=N``
  keeps the first N of each split (a fixed, documented subset: the goal order is the
  environment's, fixed by its data and seed);
* temperature 0.4, one episode per task per evaluation seed; success and score per
  episode;
* evaluation seed ``s`` seeds the generation stream (``GenerationConfig.seed = s``; a
  fresh engine per cell, so the stream does not depend on what ran before) **and** the
  perturbation draw (``xi`` of ``gaussian``, the mask of ``dropout``: a new draw per
  seed).  The deterministic families (``fisher``, ``sparsegpt``, ``rtn``) ignore the
  seed except for generation.  Every family uses the same generation seeds, so clean
  and perturbed episodes of one seed are paired;
* adapters are merged into the weights before any perturbation (the deployed form);
* ``fisher`` and ``sparsegpt`` use a calibration pool of 128 agent-interaction token
  sequences collected once from one policy's rollouts on training tasks
  (:func:`build_calibration_pool`, stored as JSON) and shared by every evaluated model;
  Fisher scores (and SparseGPT) are computed per evaluated model on that pool.

A zero strength is the identity perturbation: such a cell *is* the clean cell (same
key, same rows, computed once) and its rows are labelled with the requested family and
strength.

Cache layout (``cache_dir``, default ``runs/eval_cache/`` under the project root)::

    cells/<env>-<family>/<key>.json   one cell: {"key", "fields", "rows", "seconds", "machine", "commit", "date", "log"}
    cells/<env>-<family>/<key>.episodes.jsonl   what the agent saw and did in each episode
    fisher/<hash>.safetensors         Fisher scores of one model on one calibration pool
    file_hashes.json                  memo of file digests per (path, size, mtime, inode)

``key`` is the SHA-256 of ``fields`` (:func:`cell_fields`): :data:`EVALUATOR_VERSION`;
the model (digest of the base folder's safetensors, config and tokenizer files, or of
the tensors of a tiny model; digest of each adapter folder, in order; dtype; device
type); the env (name, data source, pool seed, step limit, the ``(split, index)`` task
list, a digest of the WebShop goals); generation (engine, temperature, top-p, response
length, batch size, stop string); the agent's prompt settings; the perturbation
(family, strength, options, and the calibration pool's hash for fisher / sparsegpt);
the evaluation seed.  Tags (method, training seed) are not part of it.

Nothing in the cache is served unverified.  A cell's JSON must parse, carry its key and
one row per task of the cell, in order; its ``log`` entry records the episode log's
SHA-256, size and line count (:func:`sprpo_lib.infra.io.file_record`), which the log
must match (cells stored before that record must have a log that parses whole, one
episode per row, or none).  A cell that fails either check is recomputed (with a
warning), log and all; :func:`load_episode_log` refuses a log that fails them with one
error naming the file.  Fisher scores, the digest memo and held-out ``eval.json`` files
are recomputed when unreadable; a calibration pool must match its recorded hash.

Modules: :mod:`~sprpo_lib.evaluate.cells` (cells, digests, the cache),
:mod:`~sprpo_lib.evaluate.calibration` (the shared pool), :mod:`~sprpo_lib.evaluate.sweep`
(:class:`EvalConfig`, :func:`evaluate`, :func:`sweep`), :mod:`~sprpo_lib.evaluate.cli`.
"""
from __future__ import annotations

from sprpo_lib.evaluate.calibration import (
           CALIBRATION_FORMAT,
           CalibrationPool,
           build_calibration_pool,
           load_calibration,
           save_calibration,
           sequences_hash,
)
from sprpo_lib.evaluate.cells import (
           CALIBRATED_FAMILIES,
           DEFAULT_CACHE,
           EVAL_SPLITS,
           EVALUATOR_VERSION,
           RANDOM_FAMILIES,
           ROW_COLUMNS,
           SPLIT_LABELS,
           ZERO_IS_IDENTITY,
           Cell,
           CellCache,
           cell_key,
           check_strength,
           clear_digest_memo,
           dir_digest,
           episode_log,
           episode_rows,
           families,
           file_digest,
           load_episode_log,
           select_tasks,
           state_dict_digest,
)
from sprpo_lib.evaluate.cli import main
from sprpo_lib.evaluate.sweep import (
           EvalConfig,
           ModelSource,
           cell_fields,
           check_adapter_dir,
           compute_cell,
           config_from_profile,
           config_from_run,
           evaluate,
           fisher_scores_cached,
           missing_cells,
           play_cell,
           sweep,
)
from sprpo_lib.infra.io import canonical_hash

__all__ = ["CALIBRATED_FAMILIES", "CALIBRATION_FORMAT", "CalibrationPool", "Cell", "CellCache", "DEFAULT_CACHE",
           "EVALUATOR_VERSION", "EVAL_SPLITS", "EvalConfig", "ModelSource", "RANDOM_FAMILIES", "ROW_COLUMNS",
           "SPLIT_LABELS", "ZERO_IS_IDENTITY", "build_calibration_pool", "canonical_hash", "cell_fields", "cell_key",
           "check_adapter_dir", "check_strength", "compute_cell", "clear_digest_memo", "config_from_profile", "config_from_run",
           "dir_digest", "episode_log", "episode_rows", "evaluate", "families", "file_digest", "fisher_scores_cached", "load_calibration",
           "load_episode_log", "main", "missing_cells", "play_cell", "save_calibration", "select_tasks", "sequences_hash",
           "state_dict_digest", "sweep"]
