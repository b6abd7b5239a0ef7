"""Mixed CUDA graphs' layout (engine/mixed_graph.py) on CPU under the Triton interpreter: each
step is staged into the static buffers a graph would replay (requests packed in batch order,
the padding request over the NULL page, empty request slots, the decode launch's splits and
`split_cap`, the sampled rows gathered by index) and the model runs eagerly on them, as the
graph would. Tokens, logprobs and finish reasons equal the plain path's on a tiny Gemma 3 (a
window shorter than the prompts) and a tiny Llama, for steps mixing decodes, prefill chunks
and prompt ends of a few tokens, in every bucket; the pool's invariants hold after each step.
The graphs themselves are captured on the GPU (tests/gpu/test_mixed_graph_cuda.py).

Set SWASERVE_TEST_TRITON_CUDA=1 to skip it (the CPU engine test of a CUDA run).
"""

from __future__ import annotations

import os

_CUDA = os.environ.get("SWASERVE_TEST_TRITON_CUDA") == "1"
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import transformers  # noqa: E402

triton = pytest.importorskip("triton")


class _Eager:
    """MixedGraphs whose `run` stages a step and runs the model eagerly on the static buffers
    (no capture on CPU); records each step's bucket and request count."""

    def __new__(cls, *args, **kwargs):
        from swaserve.engine.mixed_graph import MixedGraphs

        class Eager(MixedGraphs):
            def run(self, query_lens, context_lens, token_ids, tables, rows, fill=None):
                t = self.stage(query_lens, context_lens, token_ids, tables, rows, fill)
                self.seen.append((t, len(query_lens), sum(n > 1 for n in query_lens)))
                return self.run_eager(t, len(rows))

        g = Eager(*args, **kwargs)
        g.seen = []
        return g


def _generate(folder: str, mixed: bool) -> tuple[list, list]:
    from swaserve import Engine, SamplingParams
    from swaserve.engine.mixed_graph import MixedGraphs  # noqa: F401
    from tests.helpers import check_integrity_every_step, random_prompts

    e = Engine(model=folder, device="cpu", dtype="float32", page_size=4, kv_cache_gb=0.01,
               max_num_batched_tokens=40, attention_backend="triton")  # fmt: skip
    core = e.core
    seen = []
    if mixed:
        shape = (core.hf_config.num_attention_heads, *core.kv.max_layer_shape())
        g = _Eager(core.model, core.runner.backend, core.kv, 64, 3, core.max_model_len, shape)
        assert g.buckets == [32, 64]
        core.runner.mixed = g
        seen = g.seen
    check_integrity_every_step(e)
    prompts = random_prompts(200, [37, 6, 19, 45, 3], seed=5)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=2)
              for m in (6, 9, 5, 7, 8)]  # fmt: skip
    outs = e.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    got = [(o.token_ids, o.outputs[0].finish_reason,
            [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]  # fmt: skip
    return got, seen


@pytest.mark.skipif(_CUDA, reason="CPU engine test")
@pytest.mark.parametrize("name", ["gemma3", "llama"])
def test_mixed_graph_layout_equals_plain_steps(tmp_path, name):
    from tests.helpers import save_random_hf_model, tiny_gemma3_config

    if name == "gemma3":
        cfg = tiny_gemma3_config(vocab_size=200, sliding_window=12)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=200, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
            max_position_embeddings=512, tie_word_embeddings=False,
        )  # fmt: skip
    save_random_hf_model(cfg, tmp_path)
    want, _ = _generate(str(tmp_path), mixed=False)
    got, seen = _generate(str(tmp_path), mixed=True)
    for (gt, gf, gl), (wt, wf, wl) in zip(got, want, strict=True):
        assert gt == wt and gf == wf
        assert max(abs(a - b) for a, b in zip(gl, wl)) < 1e-4
    buckets = {t for t, _, _ in seen}
    assert buckets == {32, 64}, seen  # both buckets, so padding of many rows and of none
    assert any(b > 1 and c for _, b, c in seen), "no step mixed decodes and a chunk"
    assert any(c > 1 for _, _, c in seen), "no step with two chunks"
    assert any(c == 0 for _, _, c in seen), "no decode-only step"
