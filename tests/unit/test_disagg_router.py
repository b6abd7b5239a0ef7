"""The PD router's pure parts (swaserve/disaggregation/router.py): which instance takes a
request, and which requests never leave the router (400 with the OpenAI body)."""

from __future__ import annotations

import pytest

from swaserve.disaggregation.router import Instance, _validate, choose
from swaserve.server.app import APIError


def test_choose_least_loaded_up_instance():
    a, b, c = (Instance(f"http://h:{i}", "decode", info={}) for i in range(3))
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 1
    b.routed, c.routed = 5, 2
    assert choose([a, b, c]) is c  # least loaded; the tie goes to the one routed fewer
    c.info = None  # down
    assert choose([a, b, c]) is b
    assert choose([Instance("http://x", "prefill")]) is None


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", [1, 2], None),
        ("/v1/completions", {"model": "m"}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
         "stream_options"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]},
         "messages"),
        ("/v1/chat/completions", {"messages": [], "tools": []}, "tools"),
    ],
)
def test_malformed_requests_stop_at_the_router(path, body, param):
    with pytest.raises(APIError) as e:
        _validate(path, body)
    assert e.value.status == 400
    if param is not None:
        assert e.value.param is not None and e.value.param.startswith(param), e.value.param


def test_valid_requests_pass():
    _validate("/v1/completions", {"prompt": [1, 2, 3], "n": 2, "stream": True,
                                  "stream_options": {"include_usage": True}})
    _validate("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                       "logprobs": True, "top_logprobs": 2})
