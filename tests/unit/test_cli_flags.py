"""Engine flags come from EngineConfig's fields: booleans are switches, numbers parse, and a bad
value is an error naming its flag (a CUDA device this torch lacks included)."""

import argparse

import pytest
import torch

from swaserve.cli import add_engine_args, engine_kwargs
from swaserve.config import EngineConfig


def _parse(argv: list[str]) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return EngineConfig(**engine_kwargs(p.parse_args(argv)))


def test_bool_flags_are_switches_and_numbers_parse() -> None:
    cfg = _parse(["--disable-prefix-cache", "--disable-overlap-schedule", "--max-num-seqs", "8",
                  "--disk-cache-dir", "/tmp", "--disk-cache-gb", "1.5", "--kv-cache-gb", "2"])
    assert cfg.disable_prefix_cache is True and cfg.disable_overlap_schedule is True
    assert cfg.disable_hybrid_kv_cache is False
    assert cfg.max_num_seqs == 8 and cfg.disk_cache_gb == 1.5 and cfg.kv_cache_gb == 2.0
    default = _parse([])
    assert default.disable_prefix_cache is False and default.kv_cache_gb is None


def test_config_errors_name_the_flag() -> None:
    with pytest.raises(ValueError, match=r"^invalid --max-num-seqs 0 "):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match=r"^invalid --device 'gpu0': must be"):
        EngineConfig(device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^--device cuda:1: no CUDA device"):
            EngineConfig(device="cuda:1")
    else:
        n = torch.cuda.device_count()
        with pytest.raises(ValueError, match=rf"^--device cuda:{n}: this machine has {n}"):
            EngineConfig(device=f"cuda:{n}")


def test_cache_flag_errors_name_the_flags_before_loading() -> None:
    with pytest.raises(ValueError, match=r"^invalid --disk-cache-gb 1.0 .*needs --disk-cache-dir"):
        EngineConfig(disk_cache_gb=1.0)
    with pytest.raises(ValueError, match=r"^invalid --host-cache-policy 'x' .*must be write_back"):
        EngineConfig(host_cache_policy="x")
    with pytest.raises(ValueError, match=r"^invalid --host-cache-gb -1"):
        EngineConfig(host_cache_gb=-1)


def test_no_weights_error_names_the_load_format_flag(tmp_path) -> None:
    """A folder with a config but no safetensors: the error says `--load-format dummy`."""
    import json

    from swaserve import Engine

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"no \*\.safetensors in .*use --load-format dummy$"):
        Engine(model=str(tmp_path), device="cpu")


def test_device_defaults_fill_only_what_was_not_given(monkeypatch) -> None:
    """--max-num-seqs / --max-num-batched-tokens default by device (vLLM's rule): the CPU gets
    256 / 2,048; a GPU of >= 70 GiB 1,024 and 16,384 offline, 8,192 in the server; a smaller
    GPU 256 / 2,048; a given value always wins."""
    cpu = torch.device("cpu")
    got = EngineConfig().with_device_defaults(cpu)
    assert (got.max_num_seqs, got.max_num_batched_tokens) == (256, 2048)
    given = EngineConfig(max_num_seqs=8).with_device_defaults(cpu)
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (8, 2048)
    for gib, server, want in [(141, False, (1024, 16384)), (141, True, (1024, 8192)),
                              (24, False, (256, 2048))]:
        props = type("Props", (), {"total_memory": gib * 2**30})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, p=props: p)
        got = EngineConfig().with_device_defaults(torch.device("cuda"), server)
        assert (got.max_num_seqs, got.max_num_batched_tokens) == want
    got = EngineConfig(max_num_batched_tokens=512).with_device_defaults(torch.device("cuda"))
    assert got.max_num_batched_tokens == 512
