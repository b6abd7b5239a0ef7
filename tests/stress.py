"""Randomized engine workloads for the memory manager and the prefix cache (issue 10).

One seed gives one workload: a tiny random Gemma 3 (sliding layers of window 1..33, with or
without a full layer), a page size of 1..16, a token budget of 1..64, a pool of 0.3x..3x what
the longest request needs alone, sometimes a host tier (and a disk tier) whose loads land late
(`PageMover.emulate_async`), prompts sharing prefixes cut near page and window boundaries
(later turns extend earlier prompts with their outputs), random arrivals and random aborts
mid-prefill and mid-decode. The engine's core is driven step by step and checked:

  - `check_integrity()` after every step (pool, request tables, tree and tiers agree);
  - no step raises, whatever the cache state;
  - every request the engine accepted and we did not abort finishes with the tokens (and,
    within float tolerance, the logprobs) of a prefix-cache-off engine with a large pool,
    greedy or seeded sampling alike; none is aborted for want of memory (the context is
    capped to what one request can hold in the pool at start);
  - at idle every page is free or owned once by the cache, and evicting everything frees the
    whole pool.

With speculation (`run_workload(seed, ..., spec=True)`, issue 11), the same workload also drafts
(its drafter, K and gate drawn from the seed apart from the rest, so that a seed's workload
is the same with and without): the n-gram drafter, a planted oracle (the reference
continuation with random errors: full, partial and zero acceptances) or a random DFlash drafter
whose context K/V live in the pool's pages (host and disk tiers, SWA retirement, preemption).
Greedy requests must equal speculation off; a seeded sampling request must equal the same
speculation alone in a roomy pool (its draws depend on its drafts, which depend on its tokens
alone); every DFlash draft must equal that reference's at the same tokens; each request's
speculation counters must add up.

`run_workload(seed, ...)` raises AssertionError naming the seed; tests/unit/test_stress.py runs
fixed seeds (those that found bugs) and a sweep.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swaserve import Engine, SamplingParams
from swaserve.engine.limits import PromptError
from swaserve.memory.groups import build_layout
from swaserve.memory.manager import page_bytes

log = logging.getLogger(__name__)

VOCAB = 48
EOS = 1
KV_HEADS = 1
HEAD_DIM = {"cpu": 8, "cuda": 16}  # Triton's tl.dot needs 16 on the GPU
MAX_POS = 512
LOGPROB_TOL = 1e-3  # float32 sums in another order (batching, page size): ~1e-6 apart

# Layer patterns (S: sliding, F: full), with and without a full layer.
PATTERNS = [("S", "F"), ("S", "S", "F"), ("S",), ("F", "S"), ("S", "F", "S"), ("S", "S")]


class Models:
    """Tiny random Gemma 3 folders, one set of weights per layer pattern, one folder per
    (pattern, window): the window is a config field, the weights do not depend on it."""

    def __init__(self, root: Path, device: str = "cpu") -> None:
        self.root = root
        self.device = device
        self.head_dim = HEAD_DIM[torch.device(device).type]
        self._weights: dict[tuple[str, ...], Path] = {}
        self._refs: dict[tuple, Engine] = {}
        self.drafts: dict[tuple, dict] = {}  # a DFlash reference's drafts (record_drafts)

    def folder(self, pattern: tuple[str, ...], window: int) -> Path:
        weights = self._weights.get(pattern)
        if weights is None:
            from tests.helpers import save_random_hf_model, tiny_gemma3_config

            weights = self.root / ("w-" + "".join(pattern))
            cfg = tiny_gemma3_config(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                num_key_value_heads=KV_HEADS, head_dim=self.head_dim,
                query_pre_attn_scalar=self.head_dim,
                sliding_window=4, max_position_embeddings=MAX_POS, eos_token_id=EOS,
                layer_types=[
                    "sliding_attention" if t == "S" else "full_attention" for t in pattern
                ],
            )
            save_random_hf_model(cfg, weights)
            self._weights[pattern] = weights
        folder = self.root / f"m-{''.join(pattern)}-w{window}"
        if not folder.exists():
            folder.mkdir()
            for f in weights.iterdir():
                if f.name != "config.json":
                    (folder / f.name).symlink_to(f)
            cfg = json.loads((weights / "config.json").read_text())
            cfg["sliding_window"] = window
            (folder / "config.json").write_text(json.dumps(cfg))
        return folder

    def reference(self, folder: Path, spec: SpecChoice | None = None, k: int = 0) -> Engine:
        """The prefix-cache-off engine with a large pool: what every output must equal. With
        `spec`, the same speculation with `k` drafts a step, every step drafting (what a seeded
        sampling request must equal; its DFlash drafts are recorded in `self.drafts`)."""
        key = (folder, None) if spec is None else (folder, spec.algo, k, spec.ngram,
                                                   self.drafter(spec))
        eng = self._refs.get(key)
        if eng is None:
            kw = {} if spec is None else dict(_spec_args(spec, k, self.drafter(spec)),
                                              disable_adaptive_speculation=True)
            eng = Engine(
                model=str(folder), kv_cache_gb=0.02, disable_prefix_cache=True, page_size=16,
                max_num_batched_tokens=256, **_device_args(self.device), **kw,
            )
            if spec is not None and spec.algo == "dflash":
                self.drafts[key] = record_drafts(eng)
            self._refs[key] = eng
        return eng

    def drafter(self, spec: SpecChoice) -> Path | None:
        """A random DFlash drafter folder for `spec` (written by the reference package's
        `save_pretrained`), one per shape; None for the other drafters."""
        if spec.algo != "dflash":
            return None
        name = "-".join([
            "d", "".join(spec.target_pattern), "".join(spec.layers), f"w{spec.window}",
            f"b{spec.block}", "t" + "".join(map(str, spec.target_ids)),
        ])
        folder = self.root / name
        if not folder.exists():
            _save_random_drafter(folder, spec, self.head_dim)
        return folder


@dataclass(frozen=True)
class SpecChoice:
    """A workload's speculation. `algo`: ngram, oracle (the n-gram engine with a planted
    drafter, `StressOracle`) or dflash; `k` drafts asked a step (the engine caps it by its
    token budget); `gate`: the adaptive gate on (else every step drafts). DFlash: the random
    drafter's layers (S sliding, F full), sliding window, block size and target layer ids."""

    algo: str
    k: int
    gate: bool
    ngram: tuple[int, int] = (1, 4)
    error_p: float = 0.0  # oracle: each draft is wrong with this probability
    target_pattern: tuple[str, ...] = ()
    layers: tuple[str, ...] = ()
    window: int = 0
    block: int = 0
    target_ids: tuple[int, ...] = ()


def _spec_args(spec: SpecChoice, k: int, drafter: Path | None) -> dict:
    if spec.algo == "dflash":
        kw = {"speculative_algorithm": "dflash", "speculative_draft_model": str(drafter)}
    else:
        lo, hi = spec.ngram
        kw = {"speculative_algorithm": "ngram", "speculative_ngram_min": lo,
              "speculative_ngram_max": hi}
    if k:
        kw["speculative_num_draft_tokens"] = k
    return kw


def _save_random_drafter(folder: Path, spec: SpecChoice, head_dim: int) -> None:
    """A DFlash drafter for the stress targets (hidden 32, vocabulary 48, one KV head of the
    pool's head size), random weights large enough that every part shows."""
    import math

    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    raw = dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=VOCAB, hidden_size=32,
        num_attention_heads=2, num_key_value_heads=KV_HEADS, head_dim=head_dim,
        intermediate_size=48, num_hidden_layers=len(spec.layers),
        num_target_layers=len(spec.target_pattern), max_position_embeddings=MAX_POS,
        use_sliding_window=True, sliding_window=spec.window,
        layer_types=["sliding_attention" if t == "S" else "full_attention" for t in spec.layers],
        dflash_config={"block_size": spec.block, "mask_token_id": 0,
                       "target_layer_ids": list(spec.target_ids),
                       "input_embedding_scale": math.sqrt(32)},
    )
    model = DFlashDraftModel(Qwen3Config.from_dict(raw)).eval()
    gen = torch.Generator().manual_seed(len(folder.name))
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.3 * noise)
    model.save_pretrained(folder)


def record_drafts(eng: Engine) -> dict[tuple[int, ...], list[int]]:
    """Every DFlash proposal of `eng` from now on: the request's tokens through its last one
    (committed, not yet run) -> its drafts. The same tokens proposed again (a request
    recomputed after preemption, a prompt seen before) must give the same drafts."""
    from tests.helpers import on_dflash_proposals

    seen: dict[tuple[int, ...], list[int]] = {}

    def recorded(req, got: list[int]) -> None:
        key = tuple(req.tokens(0, req.num_computed_tokens + 1))
        had = seen.setdefault(key, got)
        n = min(len(had), len(got))
        assert had[:n] == got[:n], f"drafts after {len(key)} tokens: {had} then {got}"

    on_dflash_proposals(eng.core.spec.dflash, recorded)
    return seen


class StressOracle:
    """Drafts the reference continuation of the longest known prompt the tokens extend, each
    draft replaced by a random token with probability `error_p`, sometimes padded past the
    reference's end: full, partial and zero acceptances. Greedy workloads only (its drafts
    depend on what was submitted before, not on the request's tokens alone)."""

    def __init__(self, error_p: float, rng: random.Random) -> None:
        self.refs: dict[tuple[int, ...], list[int]] = {}
        self.error_p = error_p
        self.rng = rng

    def propose(self, tokens, k: int) -> list[int]:
        tokens = [int(t) for t in tokens]
        best = max((p for p in self.refs if tuple(tokens[: len(p)]) == p), key=len, default=None)
        if best is None:
            return []
        pos = len(tokens) - len(best)
        drafts = list(self.refs[best][pos : pos + k])
        drafts = [self.rng.randrange(VOCAB) if self.rng.random() < self.error_p else t
                  for t in drafts]
        if len(drafts) < k and self.rng.random() < 0.5:
            drafts += [self.rng.randrange(VOCAB) for _ in range(k - len(drafts))]
        return drafts


@dataclass
class Workload:
    seed: int
    pattern: tuple[str, ...]
    window: int
    page_size: int
    budget: int
    max_num_seqs: int
    num_pages: int
    host_pages: int
    disk: bool
    write_through: bool
    lag: int
    overlap: bool
    prompts: list[list[int]]
    params: list[SamplingParams]
    after: list[int | None]  # prompt i extends prompt after[i] + its output (a later turn)
    arrive_p: float
    abort_p: float
    # 0 admits eagerly and preempts (odd seeds), 1 reserves decode growth (even): both run
    conservativeness: float = 1.0
    notes: dict = field(default_factory=dict)
    spec: SpecChoice | None = None
    policy: str = "fcfs"  # --scheduling-policy; "priority": the params carry priorities
    ahead: int = 0  # --prefill-ahead-tokens (with a host tier only)


def with_priorities(w: Workload) -> Workload:
    """A third of the workloads schedule by priority, each request's drawn in [-2, 2]: the
    order changes, the outputs must not (the references run with priority 0). An rng of its
    own, so that `draw`'s workloads (and the seeds that found bugs) stay what they were."""
    rng = random.Random(w.seed * 7_368_787 + 3)
    if rng.random() >= 1 / 3:
        return w
    params = [dataclasses.replace(p, priority=rng.randint(-2, 2)) for p in w.params]
    return dataclasses.replace(w, policy="priority", params=params)


def with_prefill_ahead(w: Workload) -> Workload:
    """A third of the workloads with a host tier prefill ahead (engine/scheduler.py), R drawn
    in [1, 32]: prompts parked in the cache and admitted again must give what a roomy pool
    gives. An rng of its own, as in `with_priorities`."""
    rng = random.Random(w.seed * 2_654_435 + 7)
    if not w.host_pages or rng.random() >= 1 / 3:
        return w
    return dataclasses.replace(w, ahead=rng.randint(1, 32))


def _pages_alone(windows: list[int | None], ps: int, tokens: int) -> int:
    """Pages one request of `tokens` tokens holds at most, with the engine's watermark."""
    layout = build_layout(windows)
    slots = -(-tokens // ps)
    need = 0
    for g in layout.groups:
        need += slots if g.window is None else min(slots, -(-(g.window - 1) // ps) + 1)
    return need + len(layout.groups)


def draw(seed: int) -> Workload:
    rng = random.Random(seed)
    pattern = rng.choice(PATTERNS)
    window = rng.choice([1, 2, 3, rng.randint(1, 33), rng.randint(1, 33)])
    ps = rng.choice([1, 2, 3, 4, rng.randint(1, 16), rng.randint(1, 16)])
    max_len = rng.randint(8, 70)
    bases = [[rng.randrange(2, VOCAB) for _ in range(max_len)] for _ in range(rng.randint(1, 2))]

    def cut_point() -> int:
        # Near a page or a window boundary (or a multiple of them), sometimes anywhere.
        anchor = rng.choice([ps, window, ps + window, 2 * window, rng.randint(0, max_len)])
        k = rng.randint(1, 3) if anchor <= max_len // 3 else 1
        return max(0, min(max_len, anchor * k + rng.choice([-1, 0, 0, 1])))

    num = rng.randint(3, 9)
    prompts, params, after = [], [], []
    for i in range(num):
        if i and rng.random() < 0.25:
            after.append(rng.randrange(i))  # filled in once that prompt's output is known
            prompts.append([rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 8))])
        else:
            after.append(None)
            base = rng.choice(bases)
            cut = cut_point()
            tail = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1 if cut else 2, 12))]
            prompts.append(base[:cut] + tail)
        seeded = rng.random() < 0.3
        params.append(
            SamplingParams(
                max_tokens=rng.randint(1, 12),
                temperature=1.0 if seeded else 0.0,
                seed=rng.randrange(2**31) if seeded else None,
                ignore_eos=rng.random() < 0.7,
                logprobs=0,
            )
        )
    windows = [window if t == "S" else None for t in pattern]
    longest = max(len(p) for p in prompts) + 8 + 12 + 12  # turns grow: a rough upper bound
    need = _pages_alone(windows, ps, min(longest, MAX_POS))
    num_pages = max(3, int(need * rng.uniform(0.3, 3.0)))
    tiers = rng.choice(["none", "none", "host", "host", "host+disk", "write_through"])
    host_pages = rng.randint(2, 2 * need + 2) if tiers != "none" else 0
    return Workload(
        seed=seed, pattern=pattern, window=window, page_size=ps, budget=rng.randint(1, 64),
        max_num_seqs=rng.randint(1, 4), num_pages=num_pages, host_pages=host_pages,
        disk=tiers == "host+disk", write_through=tiers == "write_through",
        lag=rng.choice([0, 1, 2, 3]) if tiers != "none" else 0, overlap=rng.random() < 0.5,
        prompts=prompts, params=params, after=after, arrive_p=rng.uniform(0.2, 1.0),
        abort_p=rng.choice([0.0, 0.02, 0.05]), conservativeness=0.0 if seed % 2 else 1.0,
    )


def draw_spec(seed: int) -> Workload:
    """`draw(seed)`'s workload with speculation, drawn from an rng of its own: the drafter, K,
    the gate, and on some requests penalties or min_tokens (their verify rows are sampled as
    plain decoding would sample them). Oracle workloads are greedy."""
    w = draw(seed)
    rng = random.Random(seed * 104_729 + 17)
    algo = rng.choice(["ngram", "oracle", "dflash"])
    gate = rng.random() < 0.3
    if algo == "dflash":
        block = rng.randint(2, 5)
        n = len(w.pattern)
        spec = SpecChoice(
            "dflash", rng.randint(1, block - 1), gate, target_pattern=w.pattern,
            layers=tuple(rng.choice("SF") for _ in range(rng.randint(1, 2))),
            window=rng.choice([1, 2, rng.randint(1, 12)]), block=block,
            target_ids=tuple(sorted(rng.sample(range(n), rng.randint(1, n)))),
        )
    else:
        lo = rng.randint(1, 3)
        spec = SpecChoice(algo, rng.randint(1, 6), gate, ngram=(lo, rng.randint(lo, 4)),
                          error_p=rng.choice([0.0, 0.1, 0.3, 0.6]))
    params = []
    for p in w.params:
        extra: dict = {"temperature": 0.0, "seed": None} if algo == "oracle" else {}
        r = rng.random()
        if r < 0.15:
            extra["presence_penalty"] = 0.7
        elif r < 0.3:
            extra["repetition_penalty"] = 1.4
        if rng.random() < 0.2:
            extra["min_tokens"] = rng.randint(0, p.max_tokens)
        params.append(dataclasses.replace(p, **extra) if extra else p)
    # Budgets near one verify chunk (K + 1 tokens) as often as not: chunks cut short, and
    # seeded requests that must wait for room for their whole chunk.
    budget = rng.choice([w.budget, spec.k + 1, spec.k + 2, 2 * spec.k + 1, rng.randint(1, 8)])
    w = dataclasses.replace(w, params=params, spec=spec, budget=budget)
    if rng.random() < 0.5:  # requests competing for a tight pool: preemptions mid-speculation
        w = dataclasses.replace(w, max_num_seqs=rng.randint(3, 4), conservativeness=0.0,
                                num_pages=max(3, int(w.num_pages * rng.uniform(0.5, 1.0))),
                                arrive_p=1.0)
    return w


def _device_args(device: str) -> dict:
    """float32 everywhere (greedy ties and logprob tolerances stay those of the CPU); on CUDA
    few graph buckets: an engine is built per workload, and a reference engine per model and
    drafter. Piecewise and mixed graphs up to 64 tokens, a workload's largest budget: the
    references' 256-token budget took 5 buckets of each: with those captures and the warm-up
    compiles, 4 workloads of the speculative sweep took 150 s (H100, 2026-12-06; all 30 took
    43 s after stop 38). The references' longer steps run eagerly."""
    if device == "cpu":
        return {"device": "cpu"}
    return {"device": device, "dtype": "float32", "cuda_graph_max_bs": 4,
            "piecewise_cuda_graph_max_tokens": 64, "mixed_cuda_graph_max_tokens": 64}


def _gb(pages: int, bytes_per_page: int) -> float:
    return (pages + 0.5) * bytes_per_page / 2**30


def build_engine(w: Workload, folder: Path, tmp: Path, models: Models) -> Engine:
    windows = [w.window if t == "S" else None for t in w.pattern]
    if w.spec is not None and w.spec.algo == "dflash":  # the drafter's layers share the pages
        windows += [w.spec.window if t == "S" else None for t in w.spec.layers]
    bpp = page_bytes(build_layout(windows), w.page_size, KV_HEADS, models.head_dim, 4)
    device = models.device
    kw = {}
    if w.host_pages:
        kw["host_cache_gb"] = _gb(w.host_pages, bpp)
        if w.write_through:
            kw["host_cache_policy"] = "write_through"
        if w.disk:
            kw["disk_cache_dir"] = str(tmp)
            kw["disk_cache_gb"] = _gb(2 * w.host_pages, bpp)
    if w.spec is not None:
        kw.update(_spec_args(w.spec, w.spec.k, models.drafter(w.spec)))
        kw["disable_adaptive_speculation"] = not w.spec.gate
    eng = Engine(
        model=str(folder), page_size=w.page_size, kv_cache_gb=_gb(w.num_pages, bpp),
        max_num_batched_tokens=w.budget, max_num_seqs=w.max_num_seqs,
        disable_overlap_schedule=not w.overlap, schedule_conservativeness=w.conservativeness,
        scheduling_policy=w.policy, prefill_ahead_tokens=w.ahead, **_device_args(device), **kw,
    )
    assert eng.core.memory.pool.capacity == w.num_pages - 1, "pool sizing"
    if w.lag and device == "cpu":  # on CUDA the load stream lags for real
        eng.core.cache.mover.emulate_async(w.lag)
    return eng


def _reference(engine: Engine, prompt: list[int], params: SamplingParams):
    out = engine.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    lps = [lp.logprob for lp in out.outputs[0].logprobs or []]
    return out.token_ids, lps, out.outputs[0].finish_reason


def _expected(models: Models, w: Workload, folder: Path, k: int, prompt: list[int],
              params: SamplingParams):
    """What a request must give: speculation off; a seeded sampling request under n-gram or
    DFlash drafting, the same speculation alone (whose greedy requests must equal off too:
    they run there as well, so that every DFlash draft has a reference)."""
    params = dataclasses.replace(params, priority=0)  # the references schedule fcfs
    off = _reference(models.reference(folder), prompt, params)
    if w.spec is None or w.spec.algo == "oracle" or k == 0:  # 0: a budget of 1 drafts nothing
        return off
    on = _reference(models.reference(folder, w.spec, k), prompt, params)
    if params.greedy:
        assert on[0] == off[0] and on[2] == off[2], f"speculation alone: {on[0]} != {off[0]}"
        return off
    return on


def run_workload(seed: int, models: Models, tmp: Path, spec: bool = False) -> dict:
    """Run one workload (`spec`: with speculation, draw_spec); returns counters. Raises
    AssertionError naming the seed."""
    w = with_prefill_ahead(with_priorities(draw_spec(seed) if spec else draw(seed)))
    folder = models.folder(w.pattern, w.window)
    try:
        return _run(w, models, folder, tmp)
    except Exception as e:
        raise AssertionError(f"stress seed {seed} ({_describe(w)}): {e!r}") from e


def _describe(w: Workload) -> str:
    return (
        f"pattern {''.join(w.pattern)} window {w.window} page {w.page_size} budget {w.budget} "
        f"seqs {w.max_num_seqs} pages {w.num_pages} host {w.host_pages} disk {w.disk} "
        f"wt {w.write_through} lag {w.lag} overlap {w.overlap} "
        f"conservativeness {w.conservativeness} policy {w.policy} ahead {w.ahead} "
        f"prompts {len(w.prompts)}"
        + (f" spec {w.spec}" if w.spec is not None else "")
    )


def _run(w: Workload, models: Models, folder: Path, tmp: Path) -> dict:
    rng = random.Random(w.seed * 7919 + 1)
    try:
        eng = build_engine(w, folder, tmp, models)
    except ValueError as e:  # a pool below one page per group (the 0.3x end): refused at start
        assert "cannot hold one request" in str(e), e
        return {"refused": 1}
    core = eng.core
    memory = core.memory
    limit = core.max_model_len
    spec_k = core.spec.k if core.spec is not None else 0  # the engine's K (budget-capped)
    oracle = drafts = None
    if w.spec is not None and w.spec.algo == "oracle":
        oracle = core.spec.drafter = StressOracle(w.spec.error_p, random.Random(w.seed))
    if w.spec is not None and w.spec.algo == "dflash":
        drafts = record_drafts(eng)
    spec_final: dict[str, dict] = {}
    want: dict[str, tuple] = {}  # request -> reference (tokens, logprobs, finish)
    got: dict[str, list[int]] = {}
    got_lps: dict[str, list[float]] = {}
    finish: dict[str, str] = {}
    aborted: set[str] = set()
    rejected = 0
    prompts = [list(p) for p in w.prompts]
    todo = list(range(len(prompts)))
    live: list[str] = []
    steps = 0

    def submit(i: int) -> None:
        nonlocal rejected
        prompt = prompts[i]
        if w.after[i] is not None:  # a later turn: the earlier prompt + its reference output
            j = w.after[i]
            prompt = prompts[j] + list(want_of[j][0]) + prompt
            prompts[i] = prompt
        params = w.params[i]
        rid = f"s{w.seed}-{i}"
        if len(prompt) + params.max_tokens > min(limit, MAX_POS):
            try:
                core.add_request(rid, prompt, params)
            except PromptError:
                rejected += 1
                want_of[i] = ([], [], None)
                return
            raise AssertionError(f"{rid}: {len(prompt)} + {params.max_tokens} > {limit} accepted")
        want_of[i] = _expected(models, w, folder, spec_k, prompt, params)
        want[rid] = want_of[i]
        if oracle is not None:
            oracle.refs[tuple(prompt)] = want_of[i][0]
        core.add_request(rid, prompt, params)
        got[rid], got_lps[rid] = [], []
        live.append(rid)

    want_of: dict[int, tuple] = {}
    while todo or core.has_unfinished():
        while todo and (not live or rng.random() < w.arrive_p):
            i = todo[0]
            if w.after[i] is not None and w.after[i] not in want_of:
                break  # its earlier turn is not submitted yet
            todo.pop(0)
            submit(i)
            if rng.random() < 0.5:
                break
        if live and rng.random() < w.abort_p:
            rid = rng.choice(live)
            core.abort_requests([rid])
            live.remove(rid)
            aborted.add(rid)
        outs = core.step()
        steps += 1
        memory.check_integrity()
        for out in outs:
            if out.request_id in aborted:
                continue
            got[out.request_id] += out.new_token_ids
            got_lps[out.request_id] += [lp.logprob for lp in out.new_logprobs or []]
            if out.spec is not None:
                spec_final[out.request_id] = out.spec
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
                live.remove(out.request_id)
        assert steps < 20000, "no progress"
    if core.has_in_flight():
        core.step()
    # Idle: nothing held by a request; every used page owned once, by the cache.
    cache = core.cache
    cache.wait_loads()
    cache.move_pages()
    memory.check_integrity()
    stats = memory.stats()
    assert stats["pages_held_by_requests"] == 0 and stats["num_requests"] == 0, stats
    pool = memory.pool
    used = [p for p in range(1, pool.num_pages) if pool.refcount(p)]
    assert all(pool.refcount(p) == 1 for p in used), "a page held twice at idle"
    assert len(used) == cache.num_dev, f"{len(used)} pages used, {cache.num_dev} in the cache"
    spec_totals = {}  # drafts first: a request's draws follow them
    if w.spec is not None:
        spec_totals = _check_spec(w, models, folder, spec_k, spec_final, finish, drafts)
    for rid, (tokens, lps, reason) in want.items():
        if rid in aborted:
            continue
        assert finish.get(rid) in ("stop", "length"), f"{rid} finished {finish.get(rid)!r}"
        assert got[rid] == tokens, f"{rid}: tokens {got[rid]} != reference {tokens}"
        assert finish[rid] == reason, f"{rid}: {finish[rid]} != reference {reason}"
        worst = max((abs(a - b) for a, b in zip(got_lps[rid], lps)), default=0.0)
        assert worst < LOGPROB_TOL and len(got_lps[rid]) == len(lps), f"{rid}: logprobs {worst}"
    result = {
        "steps": steps,
        "requests": len(want),
        "aborted": len(aborted),
        "rejected": rejected,
        "preemptions": core.scheduler.num_preemptions,
        "parks": core.scheduler.num_parks,
        **{k: v for k, v in cache.stats().items() if isinstance(v, int)},
    }
    result.update(spec_totals)
    cache.evict(10**9)
    memory.check_integrity()
    assert pool.num_free == pool.capacity, "evicting everything left pages used"
    cache.close()
    return result


def _check_spec(w: Workload, models: Models, folder: Path, k: int, final: dict[str, dict],
                finish: dict[str, str], drafts: dict | None) -> dict[str, int]:
    """Each finished request's counters add up; every DFlash draft equals the reference's at
    the same tokens. Returns the workload's speculation counters."""
    totals = {"spec_verify": 0, "spec_proposed": 0, "spec_accepted": 0, "drafts_compared": 0}
    for rid in finish:
        s = final[rid]  # the finishing output carries the request's counters
        h = s["spec_accept_histogram"]
        assert sum(h) == s["spec_verify_ct"], (rid, s)
        assert sum(i * c for i, c in enumerate(h)) == s["spec_accepted_drafts"], (rid, s)
        assert s["spec_accepted_drafts"] <= s["spec_proposed_drafts"] <= k * s["spec_verify_ct"]
        totals["spec_verify"] += s["spec_verify_ct"]
        totals["spec_proposed"] += s["spec_proposed_drafts"]
        totals["spec_accepted"] += s["spec_accepted_drafts"]
    if drafts is not None:
        ref = models.drafts.get((folder, w.spec.algo, k, w.spec.ngram, models.drafter(w.spec)), {})
        for key, got in drafts.items():
            want = ref.get(key)
            if want is not None:
                n = min(len(got), len(want))
                assert got[:n] == want[:n], f"drafts after {len(key)} tokens: {got} != {want}"
                totals["drafts_compared"] += 1
    return totals


def run_sweep(seeds: range, models: Models, tmp: Path, spec: bool = False) -> dict[str, int]:
    """Run workloads for `seeds` (each in its own folder under tmp); the counters summed."""
    totals: dict[str, int] = {}
    for seed in seeds:
        d = tmp / str(seed)
        d.mkdir()
        t = time.perf_counter()
        for k, v in run_workload(seed, models, d, spec).items():
            totals[k] = totals.get(k, 0) + v
        # Live with `pytest --log-cli-level=INFO` (which sweep is slow on a GPU, and where)
        log.info("stress workload %d%s: %.1f s", seed, " (spec)" if spec else "",
                 time.perf_counter() - t)
    return totals


def sweep_size(default: int) -> int:
    """Workloads of the sweep: SWASERVE_STRESS_WORKLOADS overrides (longer local runs)."""
    return int(os.environ.get("SWASERVE_STRESS_WORKLOADS", default))


def seeds(start: int, count: int) -> list[int]:
    return list(range(start, start + count))

