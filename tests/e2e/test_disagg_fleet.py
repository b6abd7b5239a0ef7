"""The PD router over more than one decode instance (DESIGN §9.3), real processes on loopback:
`swaserve router` + one prefill + two decode instances of a tiny random Llama (local transfer
backend). A shared long prefix sent twice lands on the same decode instance, whose prefix
cache then holds it, so fewer KV bytes travel the second time (the transfer counters); a
decode instance that is killed is marked down and the router serves every new request
through the other one, no client error (one retry, on the router's counter)."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.e2e.disagg_servers import API_KEY, counter, idle, start_fleet

pytestmark = pytest.mark.slow  # starts its own servers

H = {"Authorization": f"Bearer {API_KEY}"}
PREFIX = "The river runs past the old mill and under the stone bridge. " * 20  # 1,240 chars


@pytest.fixture(scope="module")
def fleet(tiny_model_folder, tmp_path_factory):
    """[router, prefill, decode 0, decode 1]."""
    servers = start_fleet(tmp_path_factory.mktemp("pd-fleet"), "local", str(tiny_model_folder),
                          ("--disaggregation-timeout", "10"))
    try:
        yield servers
    finally:
        for s in reversed(servers):
            s.stop()


def complete(router, prompt: str, stream: bool = False) -> str:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": stream}
    r = httpx.post(router.base_url + "/completions", json=body, headers=H, timeout=60)
    assert r.status_code == 200, r.text
    assert "error" not in r.text, r.text
    return r.text


def sent_to(decodes: list, fn) -> list[float]:
    """KV bytes each decode instance received while `fn` ran."""
    before = [counter(d, "kv_transfer_bytes") for d in decodes]
    fn()
    return [counter(d, "kv_transfer_bytes") - b for d, b in zip(decodes, before)]


def test_a_shared_prefix_lands_on_the_same_decode_instance_and_moves_fewer_bytes(fleet):
    router, _, *decodes = fleet
    first = sent_to(decodes, lambda: complete(router, PREFIX + "What is under the bridge?"))
    home = next(i for i, b in enumerate(first) if b > 0)
    assert first[1 - home] == 0
    # Without affinity the second request would go to the other (idle, fewer routed) instance.
    again = sent_to(decodes, lambda: complete(router, PREFIX + "Who lives by the mill?"))
    assert again[1 - home] == 0 and 0 < again[home] < first[home], (first, again)
    # A prompt with no shared prefix goes by load: the other instance.
    other = sent_to(decodes, lambda: complete(router, "Count to ten. " * 30))
    assert other[home] == 0 and other[1 - home] > 0
    for d in decodes:
        idle(d)


def test_a_killed_decode_instance_is_skipped_without_client_errors(fleet):
    router, prefill, *decodes = fleet
    prompt = "A different story about a lighthouse keeper and her cat. " * 20
    first = sent_to(decodes, lambda: complete(router, prompt))
    home = next(i for i, b in enumerate(first) if b > 0)
    victim, survivor = decodes[home], decodes[1 - home]
    os.kill(victim.core_pid(), signal.SIGKILL)
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(timeout=30)
    retries = counter(router, "router_retries")
    # The next request's affinity picks the dead instance: the router retries on the other.
    for i, stream in enumerate((False, True, False, True)):
        complete(router, prompt + f" Part {i}.", stream=stream)
    complete(router, "Something else entirely. " * 20)
    assert counter(router, "router_retries") - retries == 1
    idle(survivor)
    idle(prefill)
    assert httpx.get(router.url + "/health", timeout=30).status_code == 503  # it names it
