"""The path of POST /reset_prefix_cache below HTTP: the core loop answers `reset_prefix_cache`
(False, nothing dropped, while a request runs or its grammar compiles; True after an abort, even
with that request's step still in flight), `CoreClient` waits on a future its receive task
resolves (real ZMQ sockets, a scripted core), a core that dies fails a waiting reset, and
`DPClient` answers with the AND of its replicas and forgets the affinity of those that reset."""

from __future__ import annotations

import asyncio
import shutil
import tempfile

import pytest

zmq_asyncio = pytest.importorskip("zmq.asyncio")
import zmq  # noqa: E402

from swaserve.sampling.params import SamplingParams  # noqa: E402
from swaserve.server.core_process import CoreLoop  # noqa: E402
from swaserve.server.dp_client import DPClient  # noqa: E402
from swaserve.server.ipc import (  # noqa: E402
    ABORT,
    DEAD,
    PREFIX_CACHE_RESET,
    RESET_PREFIX_CACHE,
    CoreClient,
    CoreUnavailable,
    decode,
    encode,
)
from tests.helpers import ListPipes  # noqa: E402


def _reset(loop: CoreLoop, seq: int, before: list[list] = ()) -> tuple[bool, dict]:
    """Deliver `before` then a reset; the loop's answer (ok, stats)."""
    loop.inp.queue += [encode(m) for m in before] + [encode([RESET_PREFIX_CACHE, seq])]
    loop.read_inputs(0)
    kind, answered, ok, stats = loop.out.msgs[-1]
    assert (kind, answered) == (PREFIX_CACHE_RESET, seq)
    return ok, stats


def test_core_loop_resets_only_without_requests(smollm_engine):
    core = smollm_engine.core
    loop = CoreLoop(core, ListPipes())
    ids = smollm_engine.tokenizer.encode("The old mill stands by the river. " * 8)
    short = SamplingParams(max_tokens=2)
    smollm_engine.generate(prompt_token_ids=[ids], sampling_params=short)
    assert core.memory_stats()["cache_pages"] > 0
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    loop.add([["reset-r1", ids + [42], params.to_dict()]])
    core.step()
    core.step()
    assert core.has_in_flight()  # the overlap schedule: the request's next step is launched

    ok, stats = _reset(loop, 7)
    assert ok is False and stats["memory"]["cache_pages"] > 0  # nothing dropped
    assert stats["num_running"] == 1

    # The abort goes first (messages in order); the step launched for it is read back
    # (discarded) by the reset rather than failing it.
    ok, stats = _reset(loop, 8, before=[[ABORT, ["reset-r1"]]])
    assert ok is True and stats["memory"]["cache_pages"] == 0
    assert not core.has_unfinished()
    core.memory.check_integrity()
    again = smollm_engine.generate(prompt_token_ids=[ids], sampling_params=short)
    assert again[0].num_cached_tokens == 0

    loop.compiling.append(([], []))  # a request whose grammar compiles counts as waiting
    assert _reset(loop, 9)[0] is False
    loop.compiling.clear()
    assert _reset(loop, 10)[0] is True


def test_core_client_awaits_the_answer_and_fails_when_the_core_dies():
    folder = tempfile.mkdtemp(prefix="swreset")  # short: IPC paths have a length limit
    in_addr, out_addr = f"ipc://{folder}/in", f"ipc://{folder}/out"

    async def main() -> None:
        client = CoreClient(None, in_addr, out_addr, max_queue=4)
        client.start()
        ctx = zmq_asyncio.Context()
        core_in, core_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        core_in.connect(in_addr)
        core_out.connect(out_addr)
        try:
            task = asyncio.create_task(client.reset_prefix_cache())
            assert decode(await asyncio.wait_for(core_in.recv(), 5)) == [RESET_PREFIX_CACHE, 1]
            await asyncio.sleep(0.05)
            assert not task.done()  # waits for the answer, the event loop free meanwhile
            stats = {"num_running": 0, "num_waiting": 0, "memory": {"cache_pages": 0}}
            await core_out.send(encode([PREFIX_CACHE_RESET, 1, True, stats]))
            assert await asyncio.wait_for(task, 5) is True
            assert client.stats == stats  # fresh stats came with the answer
            assert not client._resets

            task = asyncio.create_task(client.reset_prefix_cache())
            assert decode(await asyncio.wait_for(core_in.recv(), 5)) == [RESET_PREFIX_CACHE, 2]
            await core_out.send(encode([DEAD, "Traceback\nRuntimeError: boom", None]))
            with pytest.raises(CoreUnavailable, match="boom"):
                await asyncio.wait_for(task, 5)
            with pytest.raises(CoreUnavailable):
                await client.reset_prefix_cache()
        finally:
            core_in.close(0)
            core_out.close(0)
            ctx.term()
            client.close()

    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _Replica:
    def __init__(self, ok: bool) -> None:
        self.ok, self.dead, self.calls = ok, None, 0

    async def reset_prefix_cache(self) -> bool:
        self.calls += 1
        return self.ok


def test_dp_client_ands_the_replicas_and_forgets_their_affinity():
    replicas = [_Replica(True), _Replica(False)]
    dp = DPClient(replicas)  # type: ignore[arg-type]
    keys = [(64, 1)]
    dp.affinity.record(0, keys)
    dp.affinity.record(1, keys)
    assert asyncio.run(dp.reset_prefix_cache()) is False
    assert [r.calls for r in replicas] == [1, 1]  # every replica is asked
    assert dp.affinity.match(keys) == [0, 64]  # the one that reset holds no prefix now
    replicas[1].ok = True
    assert asyncio.run(dp.reset_prefix_cache()) is True
    assert dp.affinity.match(keys) == [0, 0]
