"""The server's core loop compiles a new grammar off the loop (Grammars.compile_async): the
request goes in once its grammar is compiled, a grammar that fails is a reject, and a request
aborted meanwhile is never added. The real EngineCore of the built-in chat model, with the
loop's pipes replaced by lists."""

from __future__ import annotations

import re
import time

import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("zmq")

from swaserve.sampling.params import SamplingParams  # noqa: E402
from swaserve.server.core_process import CoreLoop  # noqa: E402
from swaserve.server.ipc import ABORT, REJECT, encode  # noqa: E402
from tests.helpers import ListPipes  # noqa: E402


def _child(cid: str, engine, regex: str) -> list:
    ids = engine.tokenizer.encode("My phone number is", add_special_tokens=True)
    p = SamplingParams(max_tokens=12, temperature=0, structured_outputs={"regex": regex})
    return [cid, ids, p.to_dict()]


def _wait(loop: CoreLoop) -> None:
    deadline = time.monotonic() + 60
    while loop.compiling and time.monotonic() < deadline:
        loop.added_compiled()
        time.sleep(0.005)
    assert not loop.compiling


@pytest.fixture
def loop(smollm_engine, monkeypatch):
    """A loop on the session engine's core with a grammar cache of its own (other tests filled
    the engine's), whose requests are gone afterwards whatever the test did."""
    from swaserve.sampling.structured import Grammars

    core = smollm_engine.core
    g = core.grammars
    monkeypatch.setattr(core, "grammars", Grammars(g._load_tokenizer, g.vocab_size,
                                                   g.stop_token_ids))  # fmt: skip
    loop = CoreLoop(core, ListPipes())
    yield loop
    for futures, _ in loop.compiling:
        for f in futures:
            f.result()
    core.abort_requests(list(core.requests))
    while core.has_unfinished() or core.has_in_flight():
        core.step()


def test_new_grammar_compiles_off_the_loop(smollm_engine, loop):
    core = smollm_engine.core
    loop.add([_child("g1", smollm_engine, r"\d{3}-\d{4}")])
    assert "g1" not in core.requests and len(loop.compiling) == 1  # compiling, not added yet
    _wait(loop)
    assert "g1" in core.requests and core.requests["g1"].grammar is not None
    loop.add([_child("g2", smollm_engine, r"\d{3}-\d{4}")])  # cached now: added at once
    assert "g2" in core.requests and not loop.compiling
    tokens: dict[str, list[int]] = {"g1": [], "g2": []}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    eos = set(smollm_engine.core.eos_token_ids)
    texts = [smollm_engine.tokenizer.decode([t for t in ids if t not in eos])
             for ids in tokens.values()]  # fmt: skip
    assert all(re.fullmatch(r"\d{3}-\d{4}", t) for t in texts), texts


def test_failed_compile_is_a_reject_and_abort_drops(smollm_engine, loop, monkeypatch):
    grammars = smollm_engine.core.grammars

    def fails(spec):
        raise ValueError("structured_outputs regex cannot be used: planted")

    monkeypatch.setattr(grammars, "compile", fails)
    loop.add([_child("bad", smollm_engine, r"x{2}y")])
    _wait(loop)
    assert loop.pipes.out.msgs[-1] == [REJECT, ["bad"], "structured_outputs regex cannot be "
                                       "used: planted"]  # fmt: skip
    assert "bad" not in smollm_engine.core.requests
    monkeypatch.setattr(grammars, "compile", type(grammars).compile.__get__(grammars))
    loop.add([_child("gone", smollm_engine, r"[a-c]{4}z")])
    assert loop.compiling
    loop.inp.queue.append(encode([ABORT, ["gone"]]))
    loop.read_inputs(0)
    assert not loop.compiling  # dropped: its compile finishing adds nothing
    time.sleep(0.05)
    loop.added_compiled()
    assert "gone" not in smollm_engine.core.requests
