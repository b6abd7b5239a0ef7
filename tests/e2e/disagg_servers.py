"""Processes of the PD end-to-end tests: a router and prefill/decode instances, and what the
tests read from them (Prometheus counters, idle pools)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import API_KEY, RunningServer, free_port

GEMMA = "gemma-3-270m"
# The base model has none: Gemma's turn format, for the chat tests (every server gets it).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Gemma 3 270M: 18 layers (3 full, 15 sliding, window 512), 1 KV head of 256, float32 on CPU.
# One layer's K and V for one page of 16 tokens:
LAYER_PAGE_BYTES = 2 * 1 * 256 * 4 * 16
PAGE = 16
FULL_LAYERS, SLIDING_LAYERS, WINDOW = 3, 15, 512

__all__ = ["API_KEY", "CHAT_TEMPLATE", "GEMMA", "LAYER_PAGE_BYTES", "RunningRouter", "counter",
           "expected_bytes", "idle", "start_fleet", "start_pair"]


def expected_bytes(prompt_len: int, cached: int) -> int:
    """Full layers x the prompt past the decode side's cached prefix + sliding layers x the
    last window (the keys [P - 511, P) its first query reads), both in whole pages."""
    last = (prompt_len - 1) // PAGE
    full_pages = last - cached // PAGE + 1 if cached < prompt_len else 0
    lo = max(cached, prompt_len - WINDOW + 1)
    swa_pages = last - lo // PAGE + 1 if lo < prompt_len else 0
    return (FULL_LAYERS * full_pages + SLIDING_LAYERS * swa_pages) * LAYER_PAGE_BYTES


class RunningRouter(RunningServer):
    def __init__(self, prefill: list[str], decode: list[str], log_path: Path,
                 api_key: str | None = API_KEY) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.api_key = api_key
        self.log_path = log_path
        cmd = [sys.executable, "-m", "swaserve.cli", "router", "--port", str(self.port),
               "--prefill", *prefill, "--decode", *decode]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Listening (its /health also needs the instances: not asked here)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited:\n{self.log()[-4000:]}")
            try:
                httpx.get(self.url + "/metrics", timeout=2)
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError(f"router not ready:\n{self.log()[-4000:]}")


def start_instance(mode: str, backend: str, log_path: Path, model: str = GEMMA,
                   extra: tuple[str, ...] = ()) -> RunningServer:
    args = ["--model", model, "--device", "cpu", "--kv-cache-gb", "0.3", "--max-model-len",
            "2048", "--max-n", "4", "--chat-template", CHAT_TEMPLATE, "--disaggregation-mode", mode,
            "--disaggregation-transfer-backend", backend, *extra]
    os.environ["SWASERVE_CHECK_INTEGRITY"] = "1"  # the core checks its pool after every move
    try:
        return RunningServer(args, log_path, API_KEY)
    finally:
        del os.environ["SWASERVE_CHECK_INTEGRITY"]


def start_pair(folder: Path, backend: str, model: str = GEMMA,
               extra: tuple[str, ...] = ()) -> list[RunningServer]:
    """[router, prefill, decode], all ready (the instances load side by side)."""
    return start_fleet(folder, backend, model, extra, decodes=1)


def start_fleet(folder: Path, backend: str, model: str = GEMMA, extra: tuple[str, ...] = (),
                decodes: int = 2) -> list[RunningServer]:
    """[router, prefill, decode 0, decode 1, ...], all ready (the instances load side by
    side)."""
    started: list[RunningServer] = []
    try:
        modes = ["prefill"] + ["decode"] * decodes
        for i, mode in enumerate(modes):
            log = folder / (f"{mode}.log" if decodes == 1 else f"{mode}-{i}.log")
            started.append(start_instance(mode, backend, log, model, extra))
        for s in started:
            s.wait_ready()
        router = RunningRouter([started[0].url], [s.url for s in started[1:]],
                               folder / "router.log")
        started.insert(0, router)
        router.wait_ready()
    except BaseException:
        for s in started:
            s.stop()
        raise
    return started


def counter(srv: RunningServer, family: str) -> float:
    """A `swaserve:` counter of the server's /metrics (0 when absent)."""
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        if fam.name == "swaserve:" + family:
            return sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return 0.0


def idle(srv: RunningServer, within_s: float = 20.0) -> dict:
    """Waits until no request holds a page (the pool's stats, as the core last sent them)."""
    deadline = time.monotonic() + within_s
    while True:
        mem = httpx.get(srv.base_url + "/memory", headers=srv.headers(), timeout=10).json()
        if mem["pages_held_by_requests"] == 0 and mem["num_requests"] == 0:
            assert mem["pages_free"] + mem["pages_held_by_others"] == mem["pages_total"], mem
            return mem
        if time.monotonic() > deadline:
            raise AssertionError(f"{srv.url} still holds pages: {mem}")
        time.sleep(0.2)

