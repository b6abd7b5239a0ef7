"""What a PD instance refuses at start (DESIGN §9.3): speculation, TP and DP inside a pair, a
missing transfer library (before any model loads), and the offline Engine."""

from __future__ import annotations

import pytest

from swaserve.cli import main as cli_main
from swaserve.config import EngineConfig


@pytest.mark.parametrize(
    "flags, name",
    [
        (dict(speculative_algorithm="ngram"), "--speculative-algorithm"),
        (dict(tensor_parallel_size=2), "--tensor-parallel-size"),
        (dict(data_parallel_size=2), "--data-parallel-size"),
    ],
)
def test_refused_inside_a_pair(flags, name):
    with pytest.raises(ValueError, match=f"invalid {name} .*not supported inside a "
                                         "prefill/decode pair \\(--disaggregation-mode decode\\)"):
        EngineConfig(disaggregation_mode="decode", **flags)
    EngineConfig(**flags)  # fine outside a pair


def test_flag_values_are_checked():
    with pytest.raises(ValueError, match="--disaggregation-mode 'both'"):
        EngineConfig(disaggregation_mode="both")
    with pytest.raises(ValueError, match="--disaggregation-transfer-backend 'ucx'"):
        EngineConfig(disaggregation_transfer_backend="ucx")
    with pytest.raises(ValueError, match="--disaggregation-timeout"):
        EngineConfig(disaggregation_timeout=0)


def test_missing_nixl_is_a_clear_error_at_start(monkeypatch, capsys):
    from swaserve.disaggregation import nixl_backend

    monkeypatch.setattr(nixl_backend, "MODULES", ("no_such_nixl_module",))
    rc = cli_main(["serve", "--model", "no-such-model-is-loaded", "--disaggregation-mode",
                   "prefill", "--port", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "install the nixl-cu13 package" in err, err


def test_offline_engine_refuses_a_mode():
    from swaserve import Engine

    with pytest.raises(ValueError, match="is for `swaserve serve` only"):
        Engine(model="gemma-3-270m", device="cpu", load_format="dummy",
               disaggregation_mode="decode")
