"""Large completion notices (bootstrap.py `notice`): a long prompt's prompt logprobs travel
with the first token as the page write's notification. A 4,000-token prompt with its top-5
alternatives at every position (`prompt_logprobs=5`, or `echo` with `logprobs=5`) makes a
notice of about 0.4 MB (the top 20: 1.3 MB); it must arrive whole, after the pages, through
NIXL between two processes (UCX carries a notification of any size: measured on CPU up to
20 MB, over tcp, cma and sm) and through the local backend between processes (a ZMQ
message)."""

from __future__ import annotations

import multiprocessing as mp
import random
import time
import uuid

import torch

from swaserve.disaggregation import bootstrap as B
from swaserve.disaggregation.transfer import create_transfer_backend
from swaserve.outputs import EngineCoreOutput, Logprob
from swaserve.server.ipc import output_from_wire, output_to_wire
from tests.transfer_helpers import (
    DST,
    LAYOUT,
    SRC,
    expected_after,
    nixl_only,
    pool,
    same_bytes,
    wait,
)

PROMPT_TOKENS, TOP = 4000, 5


def long_notice(key: str, prompt_tokens: int = PROMPT_TOKENS, top: int = TOP) -> bytes:
    """The notice of a prompt with `top` prompt logprobs at every position (random values)."""
    rng = random.Random(0)

    def lp() -> Logprob:
        alts = [(rng.randrange(262_144), -rng.random() * 20) for _ in range(top)]
        return Logprob(rng.randrange(262_144), -rng.random() * 20, rng.randrange(1, 1000), alts)

    out = EngineCoreOutput(
        request_id=f"core-{key}",
        new_token_ids=[1234],
        new_logprobs=[lp()],
        prompt_logprobs=[None] + [lp() for _ in range(prompt_tokens - 1)],
        num_cached_tokens=0,
    )
    gen_state = bytes(range(256)) * 20  # a torch.Generator state is ~5 KB
    return B.encode([B.NOTICE, key, output_to_wire(out), gen_state, 3, 3 * 4096])


def test_a_long_notice_round_trips():
    data = long_notice("k.0.0")
    assert 300_000 < len(data) < 1_000_000, len(data)
    msg = B.decode(data)
    out = output_from_wire(msg[2])
    assert msg[0] == B.NOTICE and msg[1] == "k.0.0" and len(out.prompt_logprobs) == PROMPT_TOKENS
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs[-1].top) == TOP


def _receiver(conn, name: str, kind: str, expect: int) -> None:
    """Registers a pool, sends its descriptor, then reports the first `expect` notifications
    (with the pool after the first) and stays registered until told to exit."""
    torch.set_num_threads(1)
    decode = pool(24, 1)
    backend = create_transfer_backend(kind, name)
    conn.send((backend.register(decode.pages, LAYOUT), decode.pages.clone()))
    deadline, got, after = time.monotonic() + 30, [], None
    while len(got) < expect and time.monotonic() < deadline and not conn.poll(0):
        got.extend(backend.notifications())
        if got and after is None:
            after = decode.pages.clone()
        time.sleep(0.002)
    conn.send((got, after))
    conn.recv()
    backend.close()


def _send_two_notices(kind: str) -> None:
    """A notice with pages, then one alone (a decode side whose cache held the whole prompt):
    both arrive whole and in order, the pages before the first."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    tag = uuid.uuid4().hex[:8]
    name = f"decode-{tag}"
    proc = ctx.Process(target=_receiver, args=(there, name, kind, 2), daemon=True)
    proc.start()
    prefill = pool(16, 0)
    sender = create_transfer_backend(kind, f"prefill-{tag}")
    try:
        sender.register(prefill.pages, LAYOUT)
        assert here.poll(60), "the receiving process did not start"
        descriptor, before = here.recv()
        sender.connect(name, descriptor)
        notices = [long_notice(f"{tag}.0.0"), long_notice(f"{tag}.1.0", top=20)]
        for src, dst, notice in ((SRC, DST, notices[0]), ([], [], notices[1])):
            h = sender.write_pages(name, src, dst, notice, timeout_s=20)
            state, took = wait(sender, h, 25)
            assert state == "done", sender.error(h)
            sender.release(h)
        assert here.poll(40)
        got, after = here.recv()
        assert [(s, len(m)) for s, m in got] == [(sender.name, len(n)) for n in notices]
        assert [m for _, m in got] == notices
        assert same_bytes(after, expected_after(before, prefill.pages))
        here.send("exit")
        proc.join(10)
    finally:
        sender.close()
        if proc.is_alive():
            proc.kill()


@nixl_only
def test_long_notices_through_nixl_between_processes():
    _send_two_notices("nixl")


def test_long_notices_through_the_local_backend_between_processes():
    _send_two_notices("local")
