"""NCCL and CUDA graphs: NCCL's graph buffer registration (on by default when a collective is
captured in a CUDA graph) has hung and corrupted replays in other engines, so it is turned off
(`NCCL_GRAPH_REGISTER=0`) whenever a captured graph could hold a collective, before the first
communicator exists, unless the user set the variable. One decision function, tested alone."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)
VAR = "NCCL_GRAPH_REGISTER"


def nccl_graph_register(
    env: Mapping[str, str], cuda_graphs: bool, tensor_parallel: int, data_parallel: int = 1
) -> str | None:
    """The value to give NCCL_GRAPH_REGISTER, or None to leave the environment alone: "0" when
    CUDA graphs are on and there is more than one rank (T * D > 1), so a captured graph can hold
    a collective, and the user has not set the variable themselves."""
    if not cuda_graphs or tensor_parallel * data_parallel <= 1 or VAR in env:
        return None
    return "0"


def apply_nccl_guard(
    cuda_graphs: bool, tensor_parallel: int, env: MutableMapping[str, str] | None = None
) -> None:
    """Set the variable in `env` (this process's environment, which spawned ranks inherit) when
    `nccl_graph_register` says so; call before any NCCL communicator is created."""
    env = os.environ if env is None else env
    value = nccl_graph_register(env, cuda_graphs, tensor_parallel)
    if value is not None:
        env[VAR] = value
        log.info("%s=%s: CUDA graphs may capture NCCL collectives", VAR, value)
