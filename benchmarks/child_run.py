"""One benchmark run in a fresh process (the GPU empty at its start, a hang or crash costing
one row): the child prints its result as one `RESULT {json}` line."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path


def run_child(
    cmd: list[str], timeout: float, log: Path, env: dict | None = None
) -> tuple[dict | None, str, object]:
    """Run `cmd` under `timeout` seconds (in `env`, else this environment), its output to `log`;
    (the RESULT row or None, the output, the exit status or "timeout")."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
               for x in (e.stdout, e.stderr)]  # fmt: skip
        text, rc = f"{out[0]}{out[1]}\ntimed out after {timeout} s", "timeout"
    log.write_text(text)
    found = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    return (json.loads(found[-1][7:]) if found else None), text, rc


def record(row: dict, label: str, started: float, jsonl: Path) -> dict:
    """Print `row` with its wall time since `started` and append it to `jsonl`; returns it."""
    print(f"{label}: {time.perf_counter() - started:.0f} s {json.dumps(row)}", flush=True)
    with open(jsonl, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row
