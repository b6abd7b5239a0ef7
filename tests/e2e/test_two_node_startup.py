"""A node that fails while a two-node server starts (`swaserve serve -dp 2 --nnodes 2`, the tiny
random Qwen3-MoE, plain replicas): node 0 must not wait out its ready timeout (launch.py's
READY_TIMEOUT_S, 900 s) for an engine core that will never connect, but exit non-zero within
seconds, naming the node, its ranks and the reason. Node 1 joins node 0 first thing
(server/nodes.py), so node 0 watches it from then on, before its core connects:

- node 1 killed (SIGKILL to its process group: the machine gone) while its core has not
  connected: node 0 sees node 1's connection close;
- only that core killed: node 1's launcher tells node 0 why its core is gone;
- node 1 failing at start with an error only it sees (its --model does not exist there): node 1
  tells node 0 the error before it exits.

To kill node 1 before its core connects without a race, a sitecustomize on node 1's PYTHONPATH
holds every process whose command line has `--spec` (the engine core's) before any of its code
runs. Every wait is bounded (node 0's exit: 30 s after the failure)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.two_nodes import kill_node, node1_core_pid, node1_log, start_nodes, stop_pair

FLAGS = ["-dp", "2", "--nnodes", "2", "--device", "cpu", "--dtype", "float32",
         "--kv-cache-gb", "0.01", "--page-size", "4"]  # fmt: skip
HOLD_CORE = """import sys, time
if "--spec" in sys.argv:  # python -m swaserve.server.core_process --spec ...: hold it
    time.sleep(600)
"""
EXIT_S = 30  # node 0 exits this soon after node 1 failed
pytestmark = pytest.mark.slow  # two server processes of their own


def _held_core_env(tmp_path: Path) -> dict[str, str]:
    hook = tmp_path / "hold_core"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_CORE)
    return {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}


def _wait_for(what, seconds: float, node0, node1, tmp_path: Path):
    """`what()` once truthy; fails (with both logs) after `seconds`."""
    deadline = time.monotonic() + seconds
    while not (found := what()):
        assert time.monotonic() < deadline, (node0.log()[-3000:], node1_log(tmp_path)[-3000:])
        time.sleep(0.1)
    return found


def _node0_fails(node0, node1, tmp_path: Path, t0: float) -> str:
    """Node 0's exit (non-zero, within EXIT_S of t0); its log."""
    try:
        code = node0.proc.wait(timeout=EXIT_S)
    except Exception:
        logs = f"{node0.log()[-3000:]}\n--- node 1:\n{node1_log(tmp_path)[-2000:]}"
        pytest.fail(f"node 0 still waits {EXIT_S} s after node 1 failed:\n{logs}")
    took = time.monotonic() - t0
    log = node0.log()
    assert code != 0, log[-3000:]
    assert took < EXIT_S, took
    assert "serving" not in log  # it never listened
    return log


@pytest.mark.parametrize("what", ["node", "core"])
def test_node_killed_before_its_core_connects(tiny_moe_folder, tmp_path, what):
    node0, node1 = start_nodes(["--model", str(tiny_moe_folder), *FLAGS], tmp_path,
                               node1_env=_held_core_env(tmp_path))  # fmt: skip
    try:
        # node 1 started its core (held before it connects); node 0 is waiting for it
        loading = r"engine core process (\d+) is loading"
        core = _wait_for(lambda: re.search(loading, node1_log(tmp_path)), 60, node0, node1,
                         tmp_path)  # fmt: skip
        assert node1_core_pid(tmp_path, 1) == int(core.group(1))
        t0 = time.monotonic()
        if what == "node":
            kill_node(node1)
        else:
            os.kill(int(core.group(1)), signal.SIGKILL)
        log = _node0_fails(node0, node1, tmp_path, t0)
        prefix = "node 1 (dp rank 1): its engine core did not come up: "
        if what == "node":
            assert prefix + "node 1 closed its connection" in log, log[-3000:]
        else:
            assert re.search(re.escape(prefix) + r"dp rank 1's engine core process \d+ killed "
                             "by SIGKILL", log), log[-3000:]  # fmt: skip
            assert node1.wait(timeout=EXIT_S) == 1, node1_log(tmp_path)[-2000:]
    finally:
        stop_pair(node0, node1)


def test_node_failing_at_start_tells_node_0_why(tiny_moe_folder, tmp_path):
    missing = tmp_path / "not-on-node-1"
    node0, node1 = start_nodes(["--model", str(tiny_moe_folder), *FLAGS], tmp_path,
                               node1_args=("--model", str(missing)))  # fmt: skip
    try:
        assert node1.wait(timeout=60) != 0, node1_log(tmp_path)[-2000:]
        log = _node0_fails(node0, node1, tmp_path, time.monotonic())
        assert (f"node 1 (dp rank 1): its engine core did not come up: unknown model "
                f"'{missing}'") in log, log[-3000:]  # fmt: skip
    finally:
        stop_pair(node0, node1)
