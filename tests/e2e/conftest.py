"""Real server processes for the end-to-end tests.

`server`: ONE `swaserve serve` on smollm2-135m-instruct for the whole session (API key on).
`tiny_server_factory`: small servers on a tiny random Llama folder whose tokenizer has no
chat template, started per test (queue-full and kill-the-core tests), stopped at the end.
`tiny_moe_folder`: a tiny random Qwen3-MoE, no tokenizer (token ids in and out).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

API_KEY = "sk-swaserve-test"
MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.api_key = api_key
        self.log_path = log_path
        cmd = [sys.executable, "-m", "swaserve.cli", "serve", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(f"server exited with {code}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def core_pid(self) -> int:
        """The engine core: the server's child process."""
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                    return int(entry.name)
        raise RuntimeError("no engine core process found")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def check_dead_rank_1_stops_server(srv: RunningServer, body: dict) -> None:
    """Kill data-parallel rank 1's core while `body` (a streamed completion) runs: the stream
    ends with an error, /health answers 503 naming "dp rank 1", and the server exits non-zero
    within 10 s."""
    import re

    pid = int(re.search(r"engine core process (\d+) is loading .*dp rank 1", srv.log()).group(1))
    exited: list[float] = []  # when the server process ended (a health request may still wait)
    threading.Thread(target=lambda: (srv.proc.wait(), exited.append(time.monotonic())),
                     daemon=True).start()  # fmt: skip
    with httpx.stream("POST", srv.base_url + "/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        rest = list(lines)
    assert any('"error"' in line for line in rest), rest[-3:]
    statuses, health = set(), ""
    while srv.proc.poll() is None and time.monotonic() - t0 < 15:
        try:
            h = httpx.get(srv.url + "/health", timeout=5)
            statuses.add(h.status_code)
            health = health or (h.text if h.status_code == 503 else "")
        except httpx.TransportError:
            statuses.add("refused")
        time.sleep(0.1)
    assert srv.proc.wait(timeout=1) != 0
    time.sleep(0.1)  # the waiting thread's timestamp
    assert exited and exited[0] - t0 < 10, exited
    assert 503 in statuses and "dp rank 1" in health, (statuses, health)


def check_both_ranks_served(srv: RunningServer) -> list[dict]:
    """/v1/memory has data-parallel ranks 0 and 1, and /metrics counts finished requests on
    both; returns their /v1/memory entries."""
    import re

    ranks = httpx.get(srv.base_url + "/memory", timeout=10).json()["ranks"]
    assert [r["dp_rank"] for r in ranks] == [0, 1]
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    for rank in ("0", "1"):
        m = re.search(rf'swaserve:request_success_total{{dp_rank="{rank}"[^}}]*}} (\S+)', text)
        assert m and float(m.group(1)) > 0, text[:2000]
    return ranks


def kill_worker_of_rank_1(srv: RunningServer, body: dict) -> int:
    """SIGKILL the one tensor-parallel worker of data-parallel rank 1's core while `body` streams
    (kill_mid_stream's checks); returns its pid. Then the server's log is complete."""
    import re

    from tests.helpers import spawned_children

    core = int(re.search(r"engine core process (\d+) is loading .*dp rank 1", srv.log()).group(1))
    workers = spawned_children(core)
    assert len(workers) == 1, workers
    kill_mid_stream(srv, body, lambda: os.kill(workers[0], signal.SIGKILL))
    return workers[0]


def offline_greedy(folder, prompts: list[list[int]], lens: list[int], **engine) -> list[list[int]]:
    """One process's greedy tokens (ignore_eos, `lens[i]` of them) for each prompt."""
    from swaserve import Engine, SamplingParams

    one = Engine(model=str(folder), disable_fused_ops=True, **engine)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lens]
    return [o.token_ids for o in one.generate(prompt_token_ids=prompts, sampling_params=params)]


def concurrent_token_ids(
    srv: RunningServer, model: str, prompts: list[list[int]], lens: list[int]
) -> list[list[int]]:
    """The official client's completions of every prompt at once (greedy, ignore_eos): the
    token ids of each."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    client = OpenAI(base_url=srv.base_url, api_key=srv.api_key or "none")

    def complete(ids: list[int], n: int) -> list[int]:
        r = client.completions.create(
            model=model, prompt=ids, max_tokens=n, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        return r.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(complete, prompts, lens))


def kill_mid_stream(srv: RunningServer, body: dict, kill) -> None:
    """Stream `body` (a completion), call `kill()` after its first chunk: the stream ends with
    an error and the server exits non-zero within 15 s of the kill."""
    with httpx.stream("POST", srv.base_url + "/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        t0 = time.monotonic()
        kill()
        rest = list(lines)
    assert any('"error"' in line for line in rest), rest[-3:]
    assert srv.proc.wait(timeout=15) != 0
    assert time.monotonic() - t0 < 15


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    args = [
        "--model",
        MODEL,
        "--device",
        "cpu",
        "--kv-cache-gb",
        "0.5",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "64",
        "--max-n",
        "4",
        "--tool-call-parser",  # SmolLM2's template has no tool format: tool_choice "auto" reads
        "hermes",  # <tool_call> blocks (test_tools_server.py)
        "--reasoning-parser",  # answers that open with <think> (none of SmolLM2's own do)
        "qwen3",
        "--log-level",
        "info",
        "--log-stats-interval",  # the periodic stats line, soon enough for test_server_ops.py
        "1",
    ]
    srv = RunningServer(args, tmp_path_factory.mktemp("server") / "server.log", API_KEY)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer minus its chat template."""
    import torch
    import transformers

    from swaserve.engine.engine import resolve_folder

    src = resolve_folder(MODEL)
    folder = tmp_path_factory.mktemp("tiny-llama")
    cfg = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    shutil.copy(src / "tokenizer.json", folder / "tokenizer.json")
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return folder


@pytest.fixture(scope="session")
def tiny_moe_folder(tmp_path_factory) -> Path:
    from tests.helpers import save_random_hf_model, tiny_moe_config

    folder = tmp_path_factory.mktemp("moe")
    save_random_hf_model(tiny_moe_config(), folder)
    return folder


@pytest.fixture
def tiny_server_factory(tiny_model_folder, tmp_path):
    started: list[RunningServer] = []

    def start(*extra: str) -> RunningServer:
        args = [
            "--model",
            str(tiny_model_folder),
            "--device",
            "cpu",
            "--kv-cache-gb",
            "0.05",
            *extra,
        ]
        srv = RunningServer(args, tmp_path / f"tiny-{len(started)}.log")
        started.append(srv)
        srv.wait_ready()
        return srv

    yield start
    for srv in started:
        srv.stop()
