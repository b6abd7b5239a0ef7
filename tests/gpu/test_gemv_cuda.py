"""GPU only (skipped elsewhere): batch-1 and batch-2 decode through the decode GEMV path
(swaserve/ops/gemv.py, Llama-family steps of <= 2 tokens, graphed and eager), and batch 8
with SWASERVE_GEMV_ROWS=8 (the tensor-core tile), against
transformers' greedy generation in float32, and against the same engine with the path off
(SWASERVE_GEMV_ROWS=0): same tokens, logprobs within 1e-4."""

from __future__ import annotations

import pytest
import torch
import transformers

from swaserve import Engine, SamplingParams
from tests.helpers import save_random_hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NEW = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=3,
        max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("llama_gemv")
    return folder, save_random_hf_model(cfg, folder)


def _run(folder, prompts: list[list[int]], rows: str, monkeypatch, graphs: int) -> list:
    monkeypatch.setenv("SWASERVE_GEMV_ROWS", rows)
    e = Engine(model=str(folder), dtype="float32", kv_cache_gb=0.05, cuda_graph_max_bs=graphs,
               attention_backend="triton")  # fmt: skip
    assert e.core.model.model.gemv_rows == int(rows)
    p = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    outs = e.generate(prompt_token_ids=prompts, sampling_params=p)
    e.core.memory.check_integrity()
    return [[(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs] for o in outs]


@pytest.mark.parametrize("graphs", [8, 0])
# batch 8 with SWASERVE_GEMV_ROWS=8: the tiles past two rows (gemv.ROW_TILES)
@pytest.mark.parametrize(("batch", "rows"), [(1, "2"), (2, "2"), (8, "8")])
def test_gemv_decode_equals_path_off_and_transformers(tiny, monkeypatch, graphs, batch, rows):
    folder, ref = tiny
    prompts = [list(range(3, 3 + n)) for n in (9, 23, 5, 14, 31, 7, 18, 12)[:batch]]
    on = _run(folder, prompts, rows, monkeypatch, graphs)
    off = _run(folder, prompts, "0", monkeypatch, graphs)
    for a, b in zip(on, off, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) < 1e-4
    for prompt, got in zip(prompts, on, strict=True):
        ids = list(prompt)
        with torch.no_grad():  # greedy by full forwards: no EOS handling to match
            for _ in range(NEW):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
        assert [t for t, _ in got] == ids[len(prompt) :]
