"""The text environments behind one protocol (:mod:`sprpo_lib.agent.envs.base`), selected by
name from :data:`ENVIRONMENTS` (``env.name``); each entry builds a task pool from the
real data (``data_dir``, or ``$WEBSHOP_DATA`` / ``$ALFWORLD_DATA``) or the offline
default.  Modules are imported on use: ALFWorld pulls in TextWorld."""
from __future__ import annotations

from sprpo_lib.agent.envs.base import GENERATED, DataError, data_header, data_source, data_vars_kept, resolve_data_dir
from sprpo_lib.agent.envs.webshop import make_webshop_pool
from sprpo_lib.infra.registry import Registry

__all__ = ["ENVIRONMENTS", "GENERATED", "DataError", "data_header", "data_source", "make_pool", "resolve_data_dir"]

ENVIRONMENTS: Registry = Registry("environment", "env.name")


@ENVIRONMENTS.register("webshop")
def _webshop(data_dir=None, seed: int = 0):
    return make_webshop_pool(data_dir, seed=seed)


@ENVIRONMENTS.register("alfworld")
def _alfworld(data_dir=None, seed: int = 0):
    # imported on use (TextWorld is heavy); the import sets $ALFWORLD_DATA: only the user's own setting counts
    with data_vars_kept():
        from sprpo_lib.agent.envs.alfworld import make_alfworld_pool  # (see above)

    return make_alfworld_pool(data_dir, seed=seed)


def make_pool(name: str, data_dir=None, seed: int = 0):
    """The task pool of environment ``name`` (a picklable call, for worker processes)."""
    return ENVIRONMENTS.get(name)(data_dir, seed)
