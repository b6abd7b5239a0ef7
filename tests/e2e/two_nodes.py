"""Two "machines" on loopback for the two-node server tests: node 0 is a `RunningServer` (HTTP,
the rendezvous at --dist-init-addr), node 1 `swaserve serve --node-rank 1` with the same flags,
in a session of its own, so that killing its process group is the whole machine going away."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.e2e.conftest import RunningServer, free_port


def start_nodes(
    common: list[str], tmp_path: Path, node1_args: tuple[str, ...] = (),
    node1_env: dict[str, str] | None = None,
) -> tuple[RunningServer, subprocess.Popen]:
    """Both nodes with the flags `common` (--nnodes 2 among them; --dist-init-addr and
    --node-rank added here), node 1 with `node1_args` after them (the last value of a flag
    wins) and `node1_env` in its environment; nothing awaited. Node 1 logs to
    tmp_path/node1.log."""
    common = [*common, "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    log = open(tmp_path / "node1.log", "w")  # noqa: SIM115 (the process owns it)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(node1_env or {})}
    node1 = subprocess.Popen(
        [sys.executable, "-m", "swaserve.cli", "serve", *common, "--node-rank", "1",
         *node1_args],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    node0 = RunningServer([*common, "--node-rank", "0"], tmp_path / "node0.log")
    return node0, node1


def start_pair(
    common: list[str], tmp_path: Path, timeout: float = 240
) -> tuple[RunningServer, subprocess.Popen]:
    """`start_nodes`, node 0 ready."""
    node0, node1 = start_nodes(common, tmp_path)
    try:
        node0.wait_ready(timeout=timeout)
    except BaseException:
        kill_node(node1)
        raise
    return node0, node1


def kill_node(node1: subprocess.Popen) -> None:
    """The machine goes away: SIGKILL to node 1's launcher and every process it started."""
    os.killpg(node1.pid, signal.SIGKILL)


def stop_pair(node0: RunningServer, node1: subprocess.Popen) -> None:
    node0.stop()
    if node1.poll() is None:
        kill_node(node1)


def check_clean_stop(node0: RunningServer, node1: subprocess.Popen, tmp_path: Path) -> None:
    """Node 1 serves as long as node 0 does; node 0 stopped (SIGTERM), both exit 0."""
    assert node1.poll() is None
    node0.stop()
    assert node0.proc.returncode == 0, node0.log()[-2000:]
    assert node1.wait(timeout=30) == 0, node1_log(tmp_path)[-2000:]


def node1_log(tmp_path: Path) -> str:
    return (tmp_path / "node1.log").read_text(errors="replace")


def node1_core_pid(tmp_path: Path, rank: int) -> int:
    """The pid of data-parallel rank `rank`'s engine core, which node 1 started."""
    log = node1_log(tmp_path)
    m = re.search(rf"engine core process (\d+) is loading .*\(dp rank {rank} of", log)
    assert m, log[-2000:]
    return int(m.group(1))
