"""The CPU decode fast path (model/layers/cpu_decode.py, kernels/csrc/decode_stack.c) computes what the
layer-by-layer path computes, and only takes the steps it can."""
from __future__ import annotations

import pytest
import torch

from pressroom import LLM, SamplingParams
from pressroom.attention.backend import AttentionMetadata, get_attention_metadata
from pressroom.kernels import cpu
from pressroom.model.layers.cpu_decode import CpuDecodeStack, applies
from pressroom.model.layers.quant import VNNI_MAX_ROWS, q4_panels
from pressroom.model.models.llama import RopeTables

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: the fast path needs the C kernels")

PROMPTS = [{"prompt_token_ids": list(range(100, 132))}, {"prompt_token_ids": list(range(500, 517))}]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def llm(request):
    return LLM(kv_cache_memory_gib=0.05, dtype=request.param)


def _first_layers(model, k: int, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The layer-by-layer path through the first k layers, then the final norm."""
    x, residual = model.embed_tokens(ids), None
    rope = RopeTables(model.rotary, cos, sin)
    for layer in model.layers[:k]:
        x, residual = layer(rope, x, residual)
    return model.norm(x, residual)[0].float()


def _on_a_two_sequence_decode(llm, monkeypatch, compare, prompts: list[dict] = PROMPTS) -> dict:
    """Runs `compare(model, stack, input_ids, cos, sin, meta)` once, on the first real decode step of the
    prompts (two by default; before the step itself: both write the same cache slots, the second writer rewrites
    what the first wrote); returns what it returned."""
    model = llm.engine.model.model
    result: dict = {}
    forward = model.forward

    def compare_then_forward(input_ids, positions, *args, **kwargs):
        meta = get_attention_metadata()
        if applies(meta, input_ids, max_tokens=None) and input_ids.shape[0] == len(prompts) and not result:
            cos, sin = model.rotary.cos_sin(positions)
            result.update(compare(model, CpuDecodeStack.build(model), input_ids, cos, sin, meta))
        return forward(input_ids, positions, *args, **kwargs)

    monkeypatch.setattr(model, "forward", compare_then_forward)
    llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
    return result


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _tolerance(llm) -> float:
    # fp32: the same kernels in the same order, but silu's exp differs in the last bits, and an ulp can move
    # an activation across an int8 rounding step of its block (1/254 of the block's largest; the embedded
    # model's outlier channels make that step large: two such flips measured 8e-3 by layer 2 on the AVX2
    # tier). bf16: the Python path rounds every activation to bf16, the fused one keeps fp32.
    return 0.01 if llm.engine.config.model.dtype == torch.float32 else 0.03


def test_each_layer_matches_the_layer_by_layer_path(llm, monkeypatch):
    """On a real decode step of two sequences, the fused stack cut to its first k layers equals the Python
    layers."""
    def compare(model, stack, input_ids, cos, sin, meta):
        full, errors = stack.layer_ptrs, {}
        for k in (1, 2):
            stack.layer_ptrs = full[:k].contiguous()
            fused = stack.run(model.embed_tokens(input_ids), cos, sin, meta)
            errors[k] = _relative(fused, _first_layers(model, k, input_ids, cos, sin))
        return errors

    errors = _on_a_two_sequence_decode(llm, monkeypatch, compare)
    assert errors.keys() == {1, 2} and max(errors.values()) < _tolerance(llm), errors


@pytest.mark.skipif(not q4_panels(), reason="no 4-bit panels (no C compiler): past 8 tokens a step goes layer by layer")
def test_a_batch_past_the_row_kernels_runs_the_panels_and_matches(llm, monkeypatch):
    """Twelve sequences' decode step (past the 4-bit row kernel's 8) runs in the fused stack on the VNNI panels,
    and equals the Python layers (which take the same panels)."""
    prompts = [{"prompt_token_ids": list(range(2000 + 37 * i, 2020 + 37 * i))} for i in range(12)]  # no shared prefix

    def compare(model, stack, input_ids, cos, sin, meta):
        full = stack.layer_ptrs
        stack.layer_ptrs = full[:2].contiguous()
        fused = stack.run(model.embed_tokens(input_ids), cos, sin, meta)
        stack.layer_ptrs = full
        return {"takes": (stack.takes(12), stack.takes(VNNI_MAX_ROWS + 1)),
                "error": _relative(fused, _first_layers(model, 2, input_ids, cos, sin))}

    result = _on_a_two_sequence_decode(llm, monkeypatch, compare, prompts)
    assert result["takes"] == (True, False) and result["error"] < _tolerance(llm), result


def test_a_drafters_taps_match_the_layer_by_layer_path(llm, monkeypatch):
    """The outputs of the layers a drafter reads (the residual stream, HF's hidden_states[i + 1]) come out of
    the fused stack as out of the Python layers, and tapping leaves the final hidden states as they were."""
    def compare(model, stack, input_ids, cos, sin, meta):
        stack.layer_ptrs = stack.layer_ptrs[:3].contiguous()
        plain = stack.run(model.embed_tokens(input_ids), cos, sin, meta)
        hidden, taps = stack.run(model.embed_tokens(input_ids), cos, sin, meta, (2, 0))
        x, residual, ref = model.embed_tokens(input_ids), None, []
        rope = RopeTables(model.rotary, cos, sin)
        for layer in model.layers[:3]:
            x, residual = layer(rope, x, residual)
            ref.append((x + residual).float())
        return {"layer 2": _relative(taps[0], ref[2]), "layer 0": _relative(taps[1], ref[0]),
                "final": (hidden - plain).abs().max().item()}

    errors = _on_a_two_sequence_decode(llm, monkeypatch, compare)
    assert errors.keys() == {"layer 2", "layer 0", "final"} and errors["final"] == 0.0
    assert max(errors["layer 2"], errors["layer 0"]) < _tolerance(llm), errors


def test_greedy_decoding_takes_the_fast_path_and_agrees(llm):
    """fp32: the fused stack and the layer-by-layer path run the same kernels in the same order (silu included),
    so greedy tokens and their logprobs agree to the bit. The prefix cache is emptied before each run: a prompt
    served from it is computed by another path (decode rows instead of a prefill chunk), whose last bits differ."""
    if llm.engine.config.model.dtype != torch.float32:
        pytest.skip("bf16: the layer-by-layer path rounds activations to bf16, the fused one keeps fp32")
    model = llm.engine.model.model
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0, logprobs=2)
    llm.engine.kv_cache.reset_prefix_cache()
    fused = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    assert model.fused_decode and model._decode_stack is not None
    model.fused_decode, model._decode_stack = False, None
    try:
        llm.engine.kv_cache.reset_prefix_cache()
        layered = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    finally:
        model.fused_decode = None
    assert model._decode_stack is None  # the comparison really ran the other path
    for f, ref in zip(fused, layered):
        assert f.token_ids == ref.token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in f.logprobs] == \
            [{t: lp.logprob for t, lp in step.items()} for step in ref.logprobs]


def test_a_verification_of_drafts_runs_as_rows_of_the_fused_stack(llm, monkeypatch):
    """With speculation, a step that verifies drafts (one query of 1 + K tokens after a cached context) goes
    through the fused stack as rows, and greedy output stays the plain engine's token for token (each row is
    computed as the decode of that position would be)."""
    if llm.engine.config.model.dtype != torch.float32:
        pytest.skip("one dtype is enough: the rows are the same kernels")
    prompt = {"prompt_token_ids": [int(t) for t in torch.arange(300, 340).repeat(3)]}  # n-gram lookup drafts
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)
    plain = llm.generate([prompt], params)[0].outputs[0].token_ids
    spec = LLM(kv_cache_memory_gib=0.05, dtype="float32",
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive_token_budget": False})
    rows_per_call: list[int] = []
    run = cpu.decode_stack

    def counted(x, *args, **kwargs):
        rows_per_call.append(x.shape[0])
        return run(x, *args, **kwargs)

    monkeypatch.setattr(cpu, "decode_stack", counted)
    assert spec.generate([prompt], params)[0].outputs[0].token_ids == plain
    assert spec.engine.stats().spec.num_drafts > 0 and max(rows_per_call) > 1


def _meta(num_decodes: int, query_lens: list[int]) -> AttentionMetadata:
    tokens = sum(query_lens)
    loc = [0]
    for n in query_lens:
        loc.append(loc[-1] + n)
    return AttentionMetadata(num_decodes=num_decodes, num_decode_tokens=num_decodes,
                             slot_mapping=torch.arange(tokens), block_tables=torch.zeros(len(query_lens), 2,
                                                                                          dtype=torch.int64),
                             seq_lens=torch.tensor(query_lens) + 5, query_start_loc=loc,
                             seq_lens_host=[n + 5 for n in query_lens])


def test_only_all_decode_steps_of_few_tokens_apply():
    assert applies(_meta(3, [1, 1, 1]), torch.zeros(3, dtype=torch.long))
    assert not applies(_meta(2, [1, 1, 4]), torch.zeros(6, dtype=torch.long))  # a prefill chunk rides along
    # ... unless it is a short query after a cached context (a verification) and the stack takes those as rows
    assert applies(_meta(2, [1, 1, 4]), torch.zeros(6, dtype=torch.long), short_queries=True)
    fresh = _meta(2, [1, 1, 4])
    fresh.seq_lens_host[2] = 4  # no cached context: a prompt's first chunk is prefill
    assert not applies(fresh, torch.zeros(6, dtype=torch.long), short_queries=True)
    assert not applies(_meta(9, [1] * 9), torch.zeros(9, dtype=torch.long))  # past the 4-bit kernels' rows


def test_a_dense_model_is_not_supported():
    dense = LLM(kv_cache_memory_gib=0.05, quantization="none", dtype="float32")
    assert not CpuDecodeStack.supports(dense.engine.model.model)
