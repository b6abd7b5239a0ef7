"""PD disaggregation with the KV pools in VRAM (DESIGN §9.3): NIXL (UCX cuda_ipc) between two
processes on one GPU, each side in its own process as served (two NIXL agents in one process
cannot use cuda_ipc: nixl_backend.py).

(a) Backend level: a pool-shaped CUDA tensor registered in each process, scattered pages (runs
    and single pages) written from one to the other with a notification: the written pages
    equal the source's, every other byte is untouched; float32, bfloat16 and float8 pools, of
    a tiny page and of a bigger one (4-16 KB per plane page).
(b) Engine level: tests/unit/test_disagg_handshake.py's pair of tiny Gemma 3 engine cores
    (window 24, pages of 16, float32), the prefill and the decode instance each stepped by
    hand in its own process (the handshake's `side_turn`, integrity checked every turn), the
    test as the frontend: tokens, logprobs and a seeded sample equal one engine's on the same
    device, prompts from 5 to 200 tokens, bytes moved = full layers x prompt + sliding layers x
    the last window (page rounded), a decode-side prefix hit moves only what it lacks, both
    pools idle and intact at the end. Needs pyzmq (the bootstrap sockets): carry it with
    scripts/server_wheels_for_device.sh.

On CPU, NIXL moving DRAM (cma), (a) runs its float8 pools (not in the unit tests) and (b) runs
when SWASERVE_DISAGG_CPU=1 (tests/e2e covers the pair on CPU through servers): both check this
file's own logic without a GPU. On CUDA, if a write is slow or
fails, UCX_LOG_LEVEL=info UCX_PROTO_INFO=y name the transport UCX chose for the VRAM write.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
import traceback
import uuid

import pytest
import torch

from tests.transfer_helpers import (
    DST,
    LAYOUT,
    NIXL_MISSING,
    SRC,
    expected_after,
    pool,
    same_bytes,
    wait,
)

pytestmark = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])
# The pair on CPU (NIXL moving DRAM) is tests/e2e/test_disagg_server.py's: this file's run of it
# (~20 s) only on demand.
CPU_ON_DEMAND = pytest.param("cpu", marks=pytest.mark.skipif(
    os.environ.get("SWASERVE_DISAGG_CPU") != "1",
    reason="covered on CPU by tests/e2e; SWASERVE_DISAGG_CPU=1 runs it"))
DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)


# ---- (a) NIXL moves pages between two processes' pools -------------------------------------


def _pages(shape: str) -> tuple[dict, list[int], list[int]]:
    """Pool arguments (the source's; the destination has more pages) and page lists."""
    if shape == "tiny":  # 128 bytes per plane page in bf16
        return dict(num_pages=16), SRC, DST
    # 8 KB per plane page in bf16; a run of 128 pages (1 MB segments), then 200 single pages
    rng = random.Random(0)
    src = list(range(1, 129)) + rng.sample(range(129, 512), 200)
    dst = list(range(300, 428)) + rng.sample([p for p in range(1, 1024)
                                              if not 300 <= p < 428], 200)
    return dict(num_pages=512, page_size=16, heads=4, dim=64), src, dst


def _dst_pool(kw: dict, dtype: torch.dtype, device: str):
    big = {**kw, "num_pages": 2 * kw["num_pages"]}  # peers' pools may differ in pages only
    return pool(**big, seed=1, dtype=dtype, device=device)


def _cases(device: str) -> list[tuple[torch.dtype, str]]:
    """Every dtype and shape on CUDA; on CPU only float8 (NIXL moving float32 and bfloat16
    DRAM is tests/unit/test_disagg_transfer.py's)."""
    dtypes = DTYPES if device == "cuda" else (torch.float8_e4m3fn,)
    return [(dtype, shape) for dtype in dtypes for shape in ("tiny", "big")]


def _receiver(conn, device: str) -> None:
    """For each case: a destination pool (made before the NIXL agent: UCX then sees the CUDA
    context), its descriptor and the pool before; then the notifications and the pool once the
    first arrived. Reports a traceback instead on any error."""
    from swaserve.disaggregation.transfer import create_transfer_backend

    torch.set_num_threads(1)
    try:
        for i, (dtype, shape) in enumerate(_cases(device)):
            dst = _dst_pool(_pages(shape)[0], dtype, device)
            backend = create_transfer_backend("nixl", f"dst-{i}-{uuid.uuid4().hex[:6]}")
            try:
                descriptor = backend.register(dst.pages, LAYOUT)
                conn.send(("pool", backend.name, descriptor, dst.pages.to("cpu", copy=True)))
                deadline, got = time.monotonic() + 30, []
                while not got and time.monotonic() < deadline:
                    got = backend.notifications()
                    time.sleep(0.001)
                if device == "cuda":
                    torch.cuda.synchronize()
                conn.send(("landed", got, dst.pages.to("cpu", copy=True)))
                conn.recv()  # registered until the sender has checked
            finally:
                backend.close()
    except Exception:
        conn.send(("error", traceback.format_exc()))


def _expect(conn, kind: str, timeout: float = 120):
    assert conn.poll(timeout), f"nothing from the receiving process within {timeout} s"
    msg = conn.recv()
    assert msg[0] != "error", "the receiving process failed:\n" + msg[1]
    assert msg[0] == kind, msg[0]
    return msg[1:]


@pytest.mark.parametrize("device", [CUDA, "cpu"])
def test_nixl_moves_pool_pages_between_processes(device):
    from swaserve.disaggregation.transfer import create_transfer_backend

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(there, device), daemon=True)
    proc.start()
    try:
        for i, (dtype, shape) in enumerate(_cases(device)):
            kw, src_pages, dst_pages = _pages(shape)
            src = pool(**kw, seed=0, dtype=dtype, device=device)
            sender = create_transfer_backend("nixl", f"src-{i}-{uuid.uuid4().hex[:6]}")
            try:
                sender.register(src.pages, LAYOUT)
                name, descriptor, before = _expect(here, "pool")
                sender.connect(name, descriptor)
                h = sender.write_pages(name, src_pages, dst_pages, f"case-{i}".encode())
                state, took = wait(sender, h, 30)
                assert state == "done", (dtype, shape, sender.error(h))
                sender.release(h)
                notes, after = _expect(here, "landed")
                assert notes == [(sender.name, f"case-{i}".encode())], (dtype, shape)
                want = expected_after(before, src.pages.cpu(), src_pages, dst_pages)
                assert same_bytes(after, want), (dtype, shape)  # the rest untouched
                assert not same_bytes(after, before)
                here.send("next")
                print(f"{device} {dtype} {shape}: {len(src_pages)} pages in {took * 1e3:.1f} ms")
            finally:
                sender.close()
        proc.join(30)
        assert proc.exitcode == 0, proc.exitcode
    finally:
        if proc.is_alive():
            proc.kill()


# ---- (b) the PD handshake, each instance in its own process ---------------------------------

# Both instances and the reference engine: few graphs (batches here are of one request).
ENGINE_KW = dict(cuda_graph_max_bs=4, max_num_seqs=8, max_num_batched_tokens=256)


def _instance(conn, folder: str, mode: str, device: str) -> None:
    """One instance of the pair: its core and side (core_loop.build_side: NIXL registered on
    the pool), stepped by hand; `add` messages from the frontend (the test), outputs back.
    On `stop`: turns until idle, then the transfer counters and the idle check."""
    torch.set_num_threads(1)
    core = side = None
    try:
        from swaserve.disaggregation.core_loop import build_side
        from swaserve.sampling.params import SamplingParams
        from tests.unit.test_disagg_handshake import assert_idle, make_core, side_turn

        core = make_core(folder, mode, device=device, backend="nixl", **ENGINE_KW)
        side = build_side(core)  # after the pool: UCX sees the CUDA context
        conn.send(("ready", side.bootstrap.address))
        stopping = None
        while stopping is None or side.busy():
            assert stopping is None or time.monotonic() < stopping, "never idle"
            while stopping is None and conn.poll():
                msg = conn.recv()
                if msg[0] == "stop":
                    stopping = time.monotonic() + 30
                else:
                    cid, ids, params, *rest = msg[1]
                    side.add(cid, ids, SamplingParams.from_dict(params), *rest)
            outs, rejects = side_turn(core, side)
            if outs or rejects:
                conn.send(("out", outs, rejects))
            elif not core.has_unfinished():
                time.sleep(0.0005)
        assert_idle(core, side)
        conn.send(("idle", side.stats.report()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        if side is not None:
            side.close()
        if core is not None:
            core.shutdown()


class Instances:
    """The prefill and the decode instance, each in a process; this process is the frontend."""

    def __init__(self, folder: str, device: str) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = {}, {}
        for mode in ("prefill", "decode"):
            here, there = ctx.Pipe()
            self.conns[mode] = here
            self.procs[mode] = ctx.Process(target=_instance, args=(there, folder, mode, device),
                                           daemon=True)
            self.procs[mode].start()
        self.outs: dict[str, list] = {}
        self.rejects: list = []

    def receive(self, mode: str, timeout: float) -> list:
        conn = self.conns[mode]
        if not conn.poll(timeout):
            return []
        msg = conn.recv()
        assert msg[0] != "error", f"the {mode} instance failed:\n{msg[1]}"
        return msg

    def start(self) -> None:
        self.address = {}
        for mode in self.conns:
            msg = self.receive(mode, 240)
            assert msg and msg[0] == "ready", f"the {mode} instance did not start"
            self.address[mode] = msg[1]

    def submit(self, name: str, ids: list[int], params) -> str:
        from swaserve.disaggregation.bootstrap import request_key

        key, p = request_key(name, 0), params.to_dict()
        self.conns["decode"].send(("add", [name, ids, p, key, self.address["prefill"]]))
        self.conns["prefill"].send(("add", ["p" + name, ids, p, key]))
        self.outs[name] = []
        return name

    def run_until_finished(self, cid: str, limit_s: float = 60.0) -> None:
        from swaserve.server.ipc import output_from_wire

        deadline = time.monotonic() + limit_s
        while not (self.outs[cid] and self.outs[cid][-1].finish_reason):
            assert not self.rejects, self.rejects
            assert time.monotonic() < deadline, f"{cid} did not finish"
            for mode in self.conns:
                msg = self.receive(mode, 0.002)
                if msg and msg[0] == "out":
                    if mode == "decode":  # the prefill side's are the withheld first tokens
                        for w in msg[1]:
                            self.outs[w[0]].append(output_from_wire(w))
                    self.rejects += msg[2]

    def stop(self) -> dict[str, dict]:
        """Both instances idle: their transfer counters (they exit after)."""
        reports = {}
        for conn in self.conns.values():
            conn.send(("stop",))
        for mode in self.conns:
            while (msg := self.receive(mode, 60)) and msg[0] == "out":
                self.rejects += msg[2]
            assert msg and msg[0] == "idle", f"the {mode} instance did not stop"
            reports[mode] = msg[1]
        for proc in self.procs.values():
            proc.join(30)
        return reports

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> str:
    """The handshake test's model (imported here: that module needs pyzmq)."""
    pytest.importorskip("zmq", reason="pyzmq (bootstrap sockets): "
                        "scripts/server_wheels_for_device.sh carries it")
    from tests.unit.test_disagg_handshake import save_pd_model

    return save_pd_model(tmp_path_factory.mktemp("tiny_gemma3_pd"))


@pytest.mark.parametrize("device", [CUDA, CPU_ON_DEMAND])
def test_pd_pair_in_two_processes(tiny_gemma3, device):
    from swaserve import Engine, SamplingParams
    from tests.unit.test_disagg_handshake import (
        PAGE_BYTES,
        assert_same_as_reference,
        expected_bytes,
    )

    pair = Instances(tiny_gemma3, device)
    try:
        reference = Engine(model=tiny_gemma3, device=device, dtype="float32",
                           kv_cache_gb=300 * PAGE_BYTES / 2**30, **ENGINE_KW)
        pair.start()
        greedy = dict(temperature=0, ignore_eos=True)
        cases = [  # one at a time: every decode batch is the reference's batch of one
            ([5, 6, 7, 8, 9], SamplingParams(max_tokens=6, logprobs=2, prompt_logprobs=1,
                                             **greedy)),
            (list(range(10, 50)), SamplingParams(max_tokens=8, logprobs=3, **greedy)),
            (list(range(20, 120)), SamplingParams(max_tokens=8, temperature=1.0, seed=5,
                                                  ignore_eos=True)),
            ([(7 * i) % 250 + 2 for i in range(200)], SamplingParams(max_tokens=10, logprobs=1,
                                                                    **greedy)),
            # the 100-token prompt again: the decode side's prefix cache holds 96 tokens of it
            (list(range(20, 120)), SamplingParams(max_tokens=3, **greedy)),
        ]
        for k, (ids, params) in enumerate(cases):
            cid = pair.submit(f"req{k}", ids, params)
            pair.run_until_finished(cid)
            ref = reference.generate(prompt_token_ids=[ids], sampling_params=params,
                                     use_tqdm=False)[0]
            assert_same_as_reference(pair.outs[cid], ref, 0, params)
        reports = pair.stop()
        reference.core.memory.check_integrity()
    finally:
        pair.kill()
    want = sum(expected_bytes(len(ids)) for ids, _ in cases[:-1]) + expected_bytes(100, 96)
    for mode, report in reports.items():
        assert report["transfers"] == len(cases) and report["failures"] == 0, (mode, report)
        assert report["bytes"] == want, (mode, report["bytes"], want)
