#!/usr/bin/env bash
# Notebook 09 as a pilot of the cpu plan's divergence grid: Table 1's settings only, a few agent states,
# WebShop on every policy (K = 4, M = 2) and ALFWorld on each method's seed 0 (K = 2, M = 1).
# Needs the cpu profile's trained runs (sprpo-reproduce --profile cpu --only 01); writes figures/pilot/.
set -euo pipefail
cd "$(dirname "$0")/../../notebooks"
common=(-k python3 -p profile cpu -p runs_root runs/cpu/train -p cache_dir runs/cpu/eval_cache -p out_dir figures/pilot)
papermill 09_divergence.ipynb /tmp/09_pilot_webshop.ipynb "${common[@]}" -y '
envs: [webshop]
plan_changes: {divergence_states: 8, divergence_samples: 4, divergence_draws: 2, divergence_curves: {}, landscape_grid: []}'
papermill 09_divergence.ipynb /tmp/09_pilot_alfworld.ipynb "${common[@]}" -y '
envs: [alfworld]
plan_changes: {divergence_states: 4, divergence_samples: 2, divergence_draws: 1, divergence_curves: {}, landscape_grid: [],
               seeds: {vanilla: [0], gaussian: [0], sam: [0], sprpo: [0]}}'
