"""`swaserve bench offline` runs end to end (on CPU: tiny dummy model, few prompts)."""

from __future__ import annotations

import json

import transformers

from swaserve.cli import main as cli_main


def test_bench_offline_cli(tmp_path, capsys):
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, num_hidden_layers=2, max_position_embeddings=512,
        architectures=["LlamaForCausalLM"],
    )
    cfg.save_pretrained(tmp_path)
    rc = cli_main([
        "bench", "offline", "--model", str(tmp_path), "--load-format", "dummy", "--device",
        "cpu", "--kv-cache-gb", "0.01", "--num-prompts", "6", "--input-len-range", "5", "40",
        "--output-len-range", "3", "20",
    ])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_prompts"] == 6 and result["output_tokens_per_s"] > 0
    assert result["batch1_decode_ms_per_token"] > 0
