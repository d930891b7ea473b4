"""``python -m sprpo_lib.agent.envs random|expert|shopper|explorer --env alfworld --split valid_seen --tasks 50``:
the scripted baselines of :mod:`sprpo_lib.agent.envs.baselines` on any environment."""
from __future__ import annotations

import argparse
import json
import sys

from sprpo_lib.agent.envs import ENVIRONMENTS, make_pool
from sprpo_lib.agent.envs.baselines import AGENTS, play


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sprpo_lib.agent.envs", description=__doc__.split("\n")[0])
    ap.add_argument("agent", choices=list(AGENTS))
    ap.add_argument("--env", default="webshop", choices=ENVIRONMENTS.names())
    ap.add_argument("--split", nargs="*", help="splits (default: all of the pool)")
    ap.add_argument("--tasks", type=int, default=50, help="first N tasks of each split")
    ap.add_argument("--rollouts", type=int, default=1, help="episodes per task")
    ap.add_argument("--data-dir")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    pool = make_pool(args.env, args.data_dir, args.seed)
    sizes = pool.splits()
    for s in args.split or []:
        if s not in sizes:
            ap.error(f"--split {s!r}: {args.env} has splits {sorted(sizes)}")
    out = {s: play(pool, s, range(min(args.tasks, sizes[s])), args.agent, args.seed, args.rollouts)
           for s in (args.split or sizes)}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
