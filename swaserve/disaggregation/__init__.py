"""Prefill/decode disaggregation (DESIGN §9.3).

    pages_to_send.py   which pages travel (window-aware)       reserve.py     the decode side's
    transfer.py        the transfer-backend interface                         page reservation
    local_backend.py   one host (in-process or cross-process)  bootstrap.py   the handshake
    nixl_backend.py    NIXL / UCX                                             between the cores
    prefill_side.py    the prefill core's side of a pair       core_loop.py   the core loop of
    decode_side.py     the decode core's side                                 a PD instance
    transfer_stats.py  transfer counters and their metrics     router.py      `swaserve router`
"""
