"""The fresh-clone items of issue 10: the context is capped by what the KV pool holds for one
request, --max-model-len is checked against the model before the weights load, a failed
generation exits non-zero, and bad flags give one-line errors before anything loads."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

import swaserve
from swaserve import Engine, SamplingParams
from swaserve.cli import main as cli_main
from swaserve.engine.limits import PromptError, check_prompt
from swaserve.memory.groups import build_layout
from swaserve.memory.manager import MemoryManager, page_bytes
from swaserve.memory.pool import NULL_PAGE
from swaserve.outputs import CompletionOutput, RequestOutput
from tests.helpers import save_random_hf_model, tiny_gemma3_config


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Req:
    request_id: str
    num_computed_tokens: int = 0


def _held(mgr: MemoryManager, rid: str, group: int) -> int:
    return sum(p != NULL_PAGE for p in mgr.page_table(rid)[group])


# ---- the pool's bound: MemoryManager.max_request_tokens ---------------------------------------


def test_swa_footprint_bound_brute_force():
    """One SWA group, one token at a time (allocate retires what fell out of the window): the
    pages held never exceed min(ceil(L / ps), ceil((w - 1) / ps) + 1), and the peak reaches
    it: the bound that max_request_tokens uses is exact."""
    for window in range(1, 41):
        for ps in range(1, 17):
            settle = _cdiv(window - 1, ps) + 1
            mgr = MemoryManager(build_layout([window]), ps, num_pages=settle + 8)
            req, peak = _Req("r"), 0
            for length in range(1, window + 3 * ps + 2):
                assert mgr.allocate(req, 1)
                req.num_computed_tokens += 1
                held = _held(mgr, "r", 0)
                peak = max(peak, held)
                assert held <= min(_cdiv(length, ps), settle), (window, ps, length, held)
            assert peak == settle, (window, ps, peak)
            mgr.check_integrity()


def test_swa_footprint_bound_with_verify_chunks_brute_force():
    """One SWA group, verify chunks of K + 1 tokens each keeping 1..K + 1 of them (the rest
    rolled back): the pages held never exceed ceil((w - 1 + K) / ps) + 1, the bound that
    max_request_tokens(K) uses, and a chunk always fits in that many pages."""
    import random

    rng = random.Random(0)
    for window in range(1, 20):
        for ps in range(1, 9):
            for k in (1, 2, 3, 5):
                bound = _cdiv(window - 1 + k, ps) + 1
                mgr = MemoryManager(build_layout([window]), ps, num_pages=bound + 1)
                req = _Req("r")
                for _ in range(3 * (window + k) // 1 + 4):
                    assert mgr.allocate(req, k + 1), (window, ps, k)
                    req.num_computed_tokens += rng.randint(1, k + 1)
                    assert _held(mgr, "r", 0) <= bound, (window, ps, k)
                mgr.check_integrity()
    layout = build_layout([8, None])
    mgr = MemoryManager(layout, 4, 21, watermark_pages=2)
    assert mgr.max_request_tokens(0) == 60 and mgr.max_request_tokens(4) == 56


def test_max_request_tokens_fits_one_request_of_that_length():
    """Hybrid layouts (one SWA group, one full): a request of max_request_tokens tokens, grown
    one token at a time, always leaves the watermark free; one more page would not fit by the
    same bound. Page-size and window boundaries both ways."""
    for window in (1, 2, 3, 5, 8, 13, 16, 17):
        for ps in (1, 2, 3, 4, 7, 16):
            for num_pages in (4, 7, 12, 30):
                layout = build_layout([window, None])
                mgr = MemoryManager(layout, ps, num_pages, watermark_pages=len(layout.groups))
                L = mgr.max_request_tokens()
                budget = mgr.pool.capacity - mgr.watermark_pages
                settle = _cdiv(window - 1, ps) + 1
                pages = [m + min(m, settle) for m in (L // ps, L // ps + 1)]  # L, L + ps tokens
                assert L % ps == 0 and pages[0] <= budget < pages[1], (window, ps, L)
                req = _Req("r")
                for _ in range(L):
                    assert mgr.allocate(req, 1)
                    req.num_computed_tokens += 1
                    assert mgr.pool.num_free >= mgr.watermark_pages, (window, ps, num_pages)
                mgr.check_integrity()


def test_max_request_tokens_edges():
    swa_only = build_layout([8])
    # settled footprint ceil(7 / 4) + 1 = 3 pages, + 1 watermark page: grows without bound
    assert MemoryManager(swa_only, 4, 5, watermark_pages=1).max_request_tokens() == sys.maxsize
    assert MemoryManager(swa_only, 4, 4, watermark_pages=1).max_request_tokens() == 8
    hybrid = build_layout([8, None])
    assert MemoryManager(hybrid, 4, 21, watermark_pages=2).max_request_tokens() == 60
    assert MemoryManager(hybrid, 16, 2, watermark_pages=1).max_request_tokens() == 0


def test_check_prompt_names_the_pool():
    from swaserve.engine.limits import ContextLimit

    pool = ContextLimit(80, by_kv_pool=True)
    with pytest.raises(PromptError, match="80 tokens that fit in the KV pool") as e:
        check_prompt(pool, 10, SamplingParams(max_tokens=71))
    assert e.value.param == "max_tokens"
    with pytest.raises(PromptError, match="KV pool"):
        check_prompt(pool, 80, SamplingParams())
    assert check_prompt(pool, 10, SamplingParams()) == 70  # omitted: the rest of the context
    with pytest.raises(PromptError, match=r"max_model_len"):  # a plain int: the model's limit
        check_prompt(80, 10, SamplingParams(max_tokens=71))


# ---- the engine: capped context, explicit --max-model-len, the model's maximum -----------------

MAX_POS = 2048
PAGE = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = tiny_gemma3_config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8, sliding_window=13,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], max_position_embeddings=MAX_POS,
    )
    out = tmp_path_factory.mktemp("tiny_gemma3_fresh_clone")
    save_random_hf_model(cfg, out)
    return out


def _kv_gb(num_pages: int) -> float:
    """--kv-cache-gb for a pool of exactly num_pages page ids (NULL included): 4 groups of
    one layer slot, 1 KV head of 8 float32 dims."""
    pb = page_bytes(build_layout([13, 13, 13, None]), PAGE, 1, 8, 4)
    return (num_pages * pb + 0.5) / 2**30


def test_context_capped_by_the_pool(folder, caplog):
    kv_gb = _kv_gb(41)
    with caplog.at_level(logging.WARNING, logger="swaserve.engine.core"):
        eng = Engine(model=str(folder), device="cpu", page_size=PAGE, kv_cache_gb=kv_gb,
                     max_num_batched_tokens=8)
    core = eng.core
    assert len(core.layout.groups) == 4 and core.memory.pool.capacity == 40
    limit = core.max_model_len
    # 40 pages - 4 watermark: m full pages + 3 SWA groups of min(m, ceil(12 / 4) + 1 = 4)
    assert limit == core.memory.max_request_tokens() == (36 - 12) * PAGE < MAX_POS
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert str(MAX_POS) in warning and str(limit) in warning and "--kv-cache-gb" in warning
    with pytest.raises(PromptError, match=f"{limit} tokens that fit in the KV pool"):
        eng.generate(prompt_token_ids=[[5] * 10], sampling_params=SamplingParams(max_tokens=limit))
    assert core.resolve_max_tokens(10, SamplingParams()) == limit - 10
    # A request of exactly the capped length fits alone: no "cannot fit" abort.
    prompt = [4 + (i * 7) % 120 for i in range(limit - 6)]
    out = eng.generate(prompt_token_ids=[prompt], use_tqdm=False,
                       sampling_params=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].token_ids) == 6
    core.memory.check_integrity()
    # Cache off, omitted max_tokens: the rest of the capped context, to the last token.
    off = Engine(model=str(folder), device="cpu", page_size=PAGE, kv_cache_gb=kv_gb,
                 max_num_batched_tokens=8, disable_prefix_cache=True)
    out = off.generate(prompt_token_ids=[prompt[:20]], use_tqdm=False,
                       sampling_params=SamplingParams(temperature=0, ignore_eos=True))
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].token_ids) == limit - 20

    # An explicit --max-model-len that does not fit is an error naming both numbers and flags;
    # one that fits is kept, and the context error then names max_model_len.
    with pytest.raises(ValueError, match=f"--max-model-len {limit + 1} .* {limit} tokens") as e:
        Engine(model=str(folder), device="cpu", page_size=PAGE, kv_cache_gb=kv_gb,
               max_model_len=limit + 1)
    assert "--kv-cache-gb" in str(e.value)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="swaserve.engine.core"):
        exact = Engine(model=str(folder), device="cpu", page_size=PAGE, kv_cache_gb=kv_gb,
                       max_model_len=limit)
    assert exact.core.max_model_len == limit and not caplog.records
    with pytest.raises(PromptError, match="max_model_len"):
        exact.generate(prompt_token_ids=[[5] * 10],
                       sampling_params=SamplingParams(max_tokens=limit))


def test_pool_that_cannot_hold_one_request(folder):
    with pytest.raises(ValueError, match=r"cannot hold one request; raise --kv-cache-gb"):
        Engine(model=str(folder), device="cpu", page_size=PAGE, kv_cache_gb=_kv_gb(6))


def test_max_model_len_above_the_model_fails_before_the_weights(folder, monkeypatch):
    import swaserve.engine.core as core_mod

    def no_load(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(core_mod, "build_model", no_load)
    with pytest.raises(ValueError, match=f"--max-model-len {MAX_POS + 1} .* {MAX_POS} tokens"):
        Engine(model=str(folder), device="cpu", max_model_len=MAX_POS + 1)


# ---- the CLI: checked before loading, one-line errors, failed generations exit 1 ---------------


@pytest.fixture
def no_engine(monkeypatch):
    """`swaserve generate` must not build an Engine (nothing loads) for these flags."""

    class NoEngine:
        def __init__(self, *a, **k):
            raise AssertionError("the model started loading")

    monkeypatch.setattr(swaserve, "Engine", NoEngine)


@pytest.mark.parametrize("flags,flag", [
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-k", "-2"], "--top-k"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--sampling-seed", str(2**64)], "--sampling-seed"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--page-size", "0"], "--page-size"),
    (["--kv-cache-gb", "-1"], "--kv-cache-gb"),
    (["--device", "tpu:x"], "--device"),
    (["--json-schema", "{not json"], "--json-schema"),
    (["--json-schema", '{"type": "nonsense"}'], "--json-schema"),
    (["--json-schema", "@/no/such/schema.json"], "--json-schema"),
    (["--regex", "("], "--regex"),
])
def test_generate_flags_checked_before_loading(no_engine, capsys, flags, flag):
    assert cli_main(["generate", "--prompt", "Hi", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {flag}") or f" {flag} " in err, err
    assert len(err.splitlines()) == 1


def test_generate_exits_1_when_a_generation_aborted(monkeypatch, capsys):
    class AbortingEngine:
        def __init__(self, **kwargs):
            pass

        def generate(self, prompts, params):
            reasons = ["length", "abort"]
            return [RequestOutput(str(i), p, [1], [CompletionOutput(0, "x", [7], reasons[i])],
                                  finished=True) for i, p in enumerate(prompts)]

    monkeypatch.setattr(swaserve, "Engine", AbortingEngine)
    assert cli_main(["generate", "--prompt", "a", "--prompt", "b"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: prompt 2 of 2: generation aborted after 1 token (see the log above)"]


def test_bench_memory_is_strict_json_when_the_baseline_fits_none(capsys):
    assert cli_main(["bench", "memory", "--model", "gemma-3-27b", "--kv-cache-gb", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert result["max_concurrent_all_full"] == 0 and result["ratio"] is None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cli_runs():
    """The one-line-error commands, run at once as real processes: name -> (rc, stderr, s)."""
    cmds = {
        "temperature": ["generate", "--prompt", "Hi", "--temperature", "-1"],
        "kv_pool": ["generate", "--prompt", "Hi", "--device", "cpu", "--kv-cache-gb", "0.001"],
        "bench_serve": ["bench", "serve", "--base-url", f"http://127.0.0.1:{_closed_port()}",
                        "--num-prompts", "1"],
    }
    if not torch.cuda.is_available():
        cmds["cuda"] = ["generate", "--prompt", "Hi", "--device", "cuda"]
    start = time.monotonic()
    procs = {
        k: subprocess.Popen([sys.executable, "-m", "swaserve.cli", *c], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
        for k, c in cmds.items()
    }
    out = {}
    for k, p in procs.items():
        _, err = p.communicate(timeout=120)
        out[k] = (p.returncode, err.strip(), time.monotonic() - start)
    return out


def _one_line(run: tuple[int, str, float]) -> str:
    rc, err, _ = run
    # a fresh HOME converts the built-in GGUF first: its notice, progress bar and blank line
    lines = [ln for ln in err.splitlines()
             if ln.strip() and "Converting" not in ln and not ln.startswith("swaserve: converting")]
    assert rc != 0 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_cli_temperature_fails_at_once(cli_runs):
    assert _one_line(cli_runs["temperature"]) == "error: --temperature must be >= 0, got -1.0"
    assert cli_runs["temperature"][0] == 2


def test_cli_pool_too_small_fails_at_start(cli_runs):
    line = _one_line(cli_runs["kv_pool"])
    assert line == (
        "error: the KV pool (1 page of 16 tokens) cannot hold one request; raise --kv-cache-gb"
    )
    assert cli_runs["kv_pool"][0] == 2


def test_cli_bench_serve_without_a_server(cli_runs):
    line = _one_line(cli_runs["bench_serve"])
    assert line.startswith("error: cannot connect to http://127.0.0.1:"), line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_cli_device_cuda_without_cuda(cli_runs):
    line = _one_line(cli_runs["cuda"])
    assert line.startswith("error: --device cuda: no CUDA device"), line
    assert cli_runs["cuda"][0] == 2
