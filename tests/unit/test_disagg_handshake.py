"""The PD handshake in one process (DESIGN §9.3): a prefill and a decode EngineCore of a tiny
random Gemma 3 (two sliding layers of window 24, one full; pages of 16 tokens), their sides
(prefill_side.py, decode_side.py) talking over real bootstrap sockets and the in-process
local transfer backend, stepped by hand. Outputs, logprobs and seeded samples equal one
engine's; the reservation holds full pages for the prompt and SWA pages for the last window
only; bytes moved follow the window and shrink on a decode-side prefix hit; a full decode
pool makes requests wait; a failed write, a timeout and a cancel free both pools (integrity
checked after every move)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import torch

from swaserve import Engine, SamplingParams
from swaserve.config import EngineConfig
from swaserve.disaggregation import reserve as R
from swaserve.disaggregation.bootstrap import Bootstrap, request_key
from swaserve.disaggregation.decode_side import DecodeSide
from swaserve.disaggregation.local_backend import LocalBackend, LocalFabric
from swaserve.disaggregation.prefill_side import PrefillSide
from swaserve.engine.core import EngineCore
from swaserve.memory.pool import NULL_PAGE
from swaserve.server.ipc import output_from_wire, output_to_wire
from tests.helpers import save_random_hf_model, tiny_gemma3_config

PS, WINDOW = 16, 24
# Groups of one layer (swa, swa, full): a page id is K and V of 16 tokens x 2 heads of 16, fp32.
PAGE_BYTES = 2 * PS * 2 * 16 * 4


def save_pd_model(path: Path) -> str:
    """The pair's model, random weights saved in `path`."""
    cfg = tiny_gemma3_config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             max_position_embeddings=1024, eos_token_id=1)
    save_random_hf_model(cfg, path)
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_pd_model(tmp_path_factory.mktemp("tiny_gemma3_pd"))


def make_core(folder: str, mode: str | None, pages: int = 300, device: str = "cpu",
              backend: str = "local", **kw) -> EngineCore:
    """One instance of the pair (float32: PAGE_BYTES); `kw`: more EngineConfig fields."""
    cfg = EngineConfig(model=folder, device=device, dtype="float32",
                       kv_cache_gb=pages * PAGE_BYTES / 2**30, disaggregation_mode=mode,
                       disaggregation_transfer_backend=backend, **kw)
    return EngineCore(cfg, Path(folder), server=True)


def side_turn(core: EngineCore, side) -> tuple[list[list], list]:
    """One turn of one instance, in core_loop.py's order: the side's messages and transfers,
    then one engine step. Returns the wire outputs for the frontend (first tokens a decode
    side continues, then the step's; a prefill side withholds the first tokens it sends) and
    the side's rejects; the pool's integrity is checked after."""
    side.poll()
    outs, side.outputs = side.outputs, []
    if core.has_unfinished():
        outs += side.filter_outputs([output_to_wire(o) for o in core.step()])
    rejects, side.rejects = side.rejects, []
    core.memory.check_integrity()
    return outs, rejects


def assert_idle(core: EngineCore, side) -> None:
    """Nothing in flight: no samples on the side, no pages held by requests, pool intact."""
    assert not side.busy(), side.samples
    stats = core.memory.stats()
    assert stats["pages_held_by_requests"] == 0 and stats["num_requests"] == 0, stats
    core.memory.check_integrity()


def assert_same_as_reference(outs: list, ref, i: int, params: SamplingParams) -> None:
    """A pair's outputs for sample `i` of a prompt equal one engine's (`ref`, a RequestOutput):
    tokens, their logprobs and top alternatives, prompt logprobs (carried by sample 0)."""
    assert [t for o in outs for t in o.new_token_ids] == ref.outputs[i].token_ids, i
    if params.logprobs is not None:
        got = [lp for o in outs for lp in (o.new_logprobs or [])]
        want = ref.outputs[i].logprobs
        assert [g.token_id for g in got] == [w.token_id for w in want]
        assert [[t for t, _ in g.top] for g in got] == [[t for t, _ in w.top] for w in want]
        for g, w in zip(got, want):
            assert abs(g.logprob - w.logprob) < 1e-4
    if params.prompt_logprobs is not None and i == 0:
        plp = outs[0].prompt_logprobs
        assert [None if x is None else x.token_id for x in plp] == [
            None if x is None else x.token_id for x in ref.prompt_logprobs]


class Pair:
    def __init__(self, folder: str, decode_pages: int = 300, timeout: float = 10.0) -> None:
        fabric = LocalFabric()
        self.p, self.d = make_core(folder, "prefill"), make_core(folder, "decode", decode_pages)
        tag = uuid.uuid4().hex[:6]
        self.pb = LocalBackend(f"p-{tag}", fabric)
        self.db = LocalBackend(f"d-{tag}", fabric)
        self.pb.register(self.p.kv.pages, self.p.layout)
        desc = self.db.register(self.d.kv.pages, self.d.layout)
        self.ps = PrefillSide(self.p, self.pb, Bootstrap(), timeout)
        self.p.disagg = self.ps
        self.ds = DecodeSide(self.d, self.db, Bootstrap(), desc, timeout)
        self.outs: dict[str, list] = {}
        self.rejects: list = []
        self.prefill_rejects: list = []

    def submit(self, name: str, ids: list[int], params: SamplingParams, n: int = 1,
               prefill: bool = True) -> list[str]:
        cids = []
        for i in range(n):
            p = SamplingParams(**{**params.to_dict(), "n": 1,
                                  "seed": None if params.seed is None else params.seed + i})
            key = request_key(name, i)
            cid = f"{name}-{i}"
            self.ds.add(cid, ids, p, key, self.ps.bootstrap.address)
            if prefill:
                self.ps.add("p" + cid, ids, p, key)
            self.outs[cid] = []
            cids.append(cid)
        return cids

    def turn(self) -> None:
        outs, rejects = side_turn(self.d, self.ds)
        for w in outs:
            self.outs[w[0]].append(output_from_wire(w))
        self.rejects += rejects
        self.prefill_rejects += side_turn(self.p, self.ps)[1]

    def run(self, until, limit_s: float = 30.0) -> None:
        deadline = time.monotonic() + limit_s
        while not until():
            assert time.monotonic() < deadline, "the pair did not finish"
            self.turn()
            time.sleep(0.001)

    def finished(self, cids: list[str]) -> bool:
        return all(self.outs[c] and self.outs[c][-1].finish_reason for c in cids)

    def tokens(self, cid: str) -> list[int]:
        return [t for o in self.outs[cid] for t in o.new_token_ids]

    def idle(self) -> None:
        for core, side in ((self.p, self.ps), (self.d, self.ds)):
            assert_idle(core, side)


@pytest.fixture(scope="module")
def reference(folder):
    return Engine(model=folder, device="cpu", kv_cache_gb=300 * PAGE_BYTES / 2**30)


def expected_bytes(prompt_len: int, cached: int = 0) -> int:
    last = (prompt_len - 1) // PS
    full = last - cached // PS + 1
    lo = max(cached, prompt_len - WINDOW + 1)
    swa = last - lo // PS + 1 if lo < prompt_len else 0
    return (full + 2 * swa) * PAGE_BYTES


def test_reservation_is_window_aware(folder):
    d = make_core(folder, "decode")
    try:
        from swaserve.engine.request import Request

        req = Request("r", list(range(3, 103)), SamplingParams(max_tokens=4), max_tokens=4)
        free = d.memory.pool.num_free
        assert R.reserve(d.scheduler, req)
        d.memory.check_integrity()
        swa, swa1, full = d.memory.page_table("r")  # groups of one layer: swa, swa, full
        assert d.layout.groups[0].window == WINDOW and d.layout.groups[2].window is None
        assert swa1 != swa
        assert len(full) == len(swa) == 7 and NULL_PAGE not in full
        dead = (100 - WINDOW + 1) // PS  # entries whose keys no query at >= 100 reads
        assert swa[:dead] == [NULL_PAGE] * dead and NULL_PAGE not in swa[dead:]
        assert free - d.memory.pool.num_free == 7 + 2 * (7 - dead)
        assert req.num_computed_tokens == 100 and req.num_cached_tokens == 0
        R.release(d.scheduler, req)  # never computed: nothing enters the cache
        d.memory.check_integrity()
        assert d.memory.pool.num_free == free and d.cache.stats()["cache_pages"] == 0
    finally:
        d.shutdown()


def test_outputs_equal_one_engine_and_bytes_follow_the_window(folder, reference):
    pair = Pair(folder)
    cases = [
        ([5, 6, 7, 8, 9], SamplingParams(max_tokens=6, temperature=0, logprobs=2,
                                         prompt_logprobs=1), 1),
        (list(range(10, 50)), SamplingParams(max_tokens=8, temperature=0, logprobs=3), 1),
        (list(range(20, 120)), SamplingParams(max_tokens=8, temperature=1.0, seed=5,
                                              ignore_eos=True), 1),
        (list(range(30, 95)), SamplingParams(max_tokens=6, temperature=0.8, seed=9, n=3,
                                             ignore_eos=True), 3),
    ]
    for k, (ids, params, n) in enumerate(cases):
        before = pair.ds.stats.bytes
        cids = pair.submit(f"req{k}", ids, params, n)
        pair.run(lambda cids=cids: pair.finished(cids))
        ref = reference.generate(prompt_token_ids=[ids], sampling_params=params)[0]
        for i, cid in enumerate(cids):
            assert_same_as_reference(pair.outs[cid], ref, i, params)
        assert pair.ds.stats.bytes - before == n * expected_bytes(len(ids))
        assert pair.ps.stats.bytes == pair.ds.stats.bytes
    pair.run(lambda: not pair.ps.busy())
    # A decode-side prefix hit: the same 100-token prompt again moves only what it lacks.
    ids, params = cases[2][0], SamplingParams(max_tokens=3, temperature=0)
    before, hits = pair.ds.stats.bytes, pair.d.cache.stats()["cache_hit_tokens"]
    cids = pair.submit("again", ids, params)
    pair.run(lambda: pair.finished(cids))
    assert pair.d.cache.stats()["cache_hit_tokens"] - hits == 96  # whole pages of the prompt
    assert pair.ds.stats.bytes - before == expected_bytes(100, 96) < expected_bytes(100)
    assert pair.tokens(cids[0]) == reference.generate(
        prompt_token_ids=[ids], sampling_params=params)[0].outputs[0].token_ids
    pair.run(lambda: not pair.ps.busy())
    pair.idle()


def test_full_decode_pool_keeps_requests_waiting(folder, reference):
    # Room for one 200-token request at a time (13 full + 2 x 2 SWA pages, + watermark).
    pair = Pair(folder, decode_pages=36)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    a = pair.submit("a", list(range(5, 205)), params)
    b = pair.submit("b", list(range(7, 207)), params)
    pair.run(lambda: pair.ds.samples.get(request_key("a", 0)) is None
             or pair.ds.samples[request_key("a", 0)].state != "waiting")
    assert pair.ds.samples[request_key("b", 0)].state == "waiting"
    pair.run(lambda: pair.finished(a + b))
    for cid, ids in ((a[0], range(5, 205)), (b[0], range(7, 207))):
        ref = reference.generate(prompt_token_ids=[list(ids)], sampling_params=params)[0]
        assert pair.tokens(cid) == ref.outputs[0].token_ids
    pair.run(lambda: not pair.ps.busy())
    pair.idle()


def test_failures_free_both_pools(folder):
    pair = Pair(folder, timeout=0.5)
    params = SamplingParams(max_tokens=4, temperature=0)
    # The decode side's pool goes away: the write fails, both sides fail the request.
    ids = list(range(40, 90))
    (cid,) = pair.submit("w", ids, params, prefill=False)
    pair.run(lambda: request_key("w", 0) in pair.ps.samples)  # its reservation arrived
    pair.db._bytes = None  # as if its process had closed the pool: writes to it fail
    pair.ps.add("p" + cid, ids, params, request_key("w", 0))
    pair.run(lambda: pair.rejects)
    assert "transfer to the decode instance failed" in pair.rejects[0][1]
    assert pair.prefill_rejects and pair.ps.stats.failures == pair.ds.stats.failures == 1
    pair.db._bytes = pair.d.kv.pages.view(-1).view(torch.uint8)
    pair.idle()
    # The prefill side never gets its half: the decode side times out, the prefill side drops
    # the reservation it was told of.
    pair.rejects.clear()
    (cid,) = pair.submit("t", list(range(40, 90)), params, prefill=False)
    pair.run(lambda: pair.rejects and not pair.ps.busy() and not pair.ds.busy())
    assert "within 0.5 s" in pair.rejects[0][1]  # its own timeout, or the prefill side's
    pair.idle()
    # The client leaves after the reservation: cancel, acked, then the pages go.
    (cid,) = pair.submit("c", list(range(40, 90)), params, prefill=False)
    pair.run(lambda: pair.ds.samples[request_key("c", 0)].state == "reserved")
    pair.ds.abort([cid])
    assert pair.ds.samples[request_key("c", 0)].state == "cancelling"
    pair.run(lambda: not pair.ds.busy() and not pair.ps.busy())
    pair.idle()
    # Aborted on the prefill side while computing: the decode side hears of it at once.
    pair.rejects.clear()
    (cid,) = pair.submit("x", ids, params, prefill=False)
    pair.run(lambda: request_key("x", 0) in pair.ps.samples)
    pair.ps.add("p" + cid, ids, params, request_key("x", 0))  # starts: the reservation is here
    assert pair.ps.samples[request_key("x", 0)].req is not None
    pair.ps.abort(["p" + cid])
    pair.run(lambda: pair.rejects)
    assert "aborted" in pair.rejects[0][1]
    pair.idle()
