"""Prefill/decode disaggregation (DESIGN §9.3).

Inside an instance's engine core:

    pages_to_send.py   which pages travel (window-aware)       reserve.py     the decode side's
    transfer.py        the transfer-backend interface                         page reservation
    local_backend.py   one host (in-process or cross-process)  bootstrap.py   the handshake
    nixl_backend.py    NIXL / UCX                                             between the cores
    prefill_side.py    the prefill core's side of a pair       core_loop.py   the core loop of
    decode_side.py     the decode core's side                                 a PD instance
    transfer_stats.py  transfer counters and their metrics

The router (`swaserve router`):

    router.py          instances up and down, the HTTP app     forward.py     one request through
    instance_pool.py   which instance (prefix affinity, load)                 a pair, retries
    prompt_keys.py     the prompt prefix affinity keys on
"""
