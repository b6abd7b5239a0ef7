"""A stream that fell behind sends what waits in its queue as one delta per request
(server/app.py `_events`, `_coalesce`, outputs.merge_deltas): samples' text, token ids and
logprobs joined in order, the later finish, prompt logprobs kept; a failure ends the stream
after what came before it. The property that merged deltas equal the whole output, with stop
strings, n > 1 and --stream-interval, is in test_output_processor.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from swaserve.outputs import CompletionOutput, Logprob, RequestOutput, merge_deltas
from swaserve.server.app import _coalesce, _events
from swaserve.server.ipc import RequestFailed


def _delta(rid: str, *samples: tuple, finished: bool = False, **kw) -> RequestOutput:
    """samples: (index, text, token ids, finish reason)."""
    outs = [
        CompletionOutput(i, text, list(ids), finish, logprobs=[Logprob(t, -1.0, 1) for t in ids])
        for i, text, ids, finish in samples
    ]
    return RequestOutput(rid, None, [1, 2], outs, finished=finished, **kw)


def test_merge_joins_samples_in_order_and_keeps_the_first_prompt_logprobs():
    plp = [None, Logprob(2, -0.5, 1)]
    a = _delta("r", (0, "He", [5], None), num_cached_tokens=2, prompt_logprobs=plp)
    b = _delta("r", (1, " x", [9], None), (0, "llo", [6, 7], None))
    c = _delta("r", (0, "!", [8], "stop"), (1, "", [], "length"), finished=True,
               spec_decoding={"spec_verify_ct": 0})  # fmt: skip
    m = merge_deltas(merge_deltas(a, b), c)
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in m.outputs] == [
        (0, "Hello!", [5, 6, 7, 8], "stop"),
        (1, " x", [9], "length"),
    ]
    assert [lp.token_id for lp in m.outputs[0].logprobs] == [5, 6, 7, 8]
    assert m.prompt_logprobs == plp and m.num_cached_tokens == 2
    assert m.finished and m.spec_decoding == {"spec_verify_ct": 0}


def test_coalesce_one_delta_per_request_and_a_failure_ends_them():
    items = [
        ("a", _delta("a", (0, "1", [1], None))),
        ("b", _delta("b", (0, "x", [7], None))),
        ("a", _delta("a", (0, "2", [2], None))),
        ("a", _delta("a", (0, "3", [3], None))),
    ]
    got = list(_coalesce(items))
    assert [(rid, ro.outputs[0].text) for rid, ro in got] == [("a", "123"), ("b", "x")]
    fail = RequestFailed("engine core died", 503)
    got = list(_coalesce([items[0], ("b", fail), items[2]]))
    assert [rid for rid, _ in got] == ["a", "b"] and got[1][1] is fail


def test_events_sends_what_waits_as_one_delta():
    aborted: list[str] = []
    state = SimpleNamespace(client=SimpleNamespace(abort=aborted.append))

    async def run() -> list:
        queue: asyncio.Queue = asyncio.Queue()
        for i, text in enumerate(["a", "b", "c"]):
            queue.put_nowait(("r", _delta("r", (0, text, [i], "length" if i == 2 else None),
                                          finished=i == 2)))  # fmt: skip
        return [ev async for ev in _events(state, queue, ["r"])]

    (ev,) = asyncio.run(run())
    rid, ro = ev
    assert rid == "r" and ro.finished and ro.outputs[0].text == "abc"
    assert ro.outputs[0].token_ids == [0, 1, 2] and aborted == ["r"]  # abort: a no-op once done
