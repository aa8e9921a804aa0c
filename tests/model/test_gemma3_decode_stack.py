"""Gemma 3's fused CPU decode step (model/layers/cpu_decode.Gemma3DecodeStack, kernels/csrc/gemma3_stack.c) on a
tiny random Gemma 3 GGUF whose projections come in Q5_0, Q8_0, Q4_K, Q5_K and Q6_K (q/k/v and gate/up each two
types, so both stacked products have two parts) with a Q8_0 tied head, three layers (two local with an 8-token
window the prompts and decodes cross, one global): in fp32 the fused step gives the layer-by-layer path's
logprobs bit for bit (the same C kernels in the same order), and the step really goes through it."""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from test_gguf_ggml_forms import _random_blocks

from pressroom import LLM, SamplingParams
from pressroom.kernels import cpu
from pressroom.model.layers.cpu_decode import Gemma3DecodeStack
from pressroom.model.layers.quant import GgmlStack
from pressroom.platforms.cpu import CpuIsa, cpu_info

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: the fused stack needs the C kernels")

T = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS, WINDOW = 256, 2, 1, 256, 512, 320, 3, 8
TYPES = {"attn_q": T.Q5_0, "attn_k": T.Q5_0, "attn_v": T.Q8_0, "attn_output": T.Q4_K, "ffn_gate": T.Q5_K,
         "ffn_up": T.Q5_0, "ffn_down": T.Q6_K}
SHAPES = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
          "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
          "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
NORMS = {"attn_norm": HIDDEN, "attn_q_norm": HEAD_DIM, "attn_k_norm": HEAD_DIM, "post_attention_norm": HIDDEN,
         "ffn_norm": HIDDEN, "post_ffw_norm": HIDDEN}
PROMPTS = [[2, *range(10, 14)], [2, *range(40, 60)], [2, *range(100, 111)]]


def _write_gemma3(path: str) -> None:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "gemma3")
    for add, value in [(writer.add_block_count, LAYERS), (writer.add_context_length, 256),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, FFN),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_key_length, HEAD_DIM), (writer.add_value_length, HEAD_DIM),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_rope_freq_base, 1e6),
                       (writer.add_sliding_window, WINDOW), (writer.add_bos_token_id, 2), (writer.add_eos_token_id, 1)]:
        add(value)
    writer.add_uint32("gemma3.attention.sliding_window_pattern", 3)  # layers 0, 1 local, 2 global
    embd = _random_blocks(T.Q8_0, VOCAB, HIDDEN, rng)
    embd.reshape(VOCAB, -1, 34)[..., :2] = np.full((VOCAB, HIDDEN // 32, 1), 2e-3, np.float16).view(np.uint8)
    writer.add_tensor("token_embd.weight", embd, raw_dtype=T.Q8_0)
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    for i in range(LAYERS):
        for name, (rows, cols) in SHAPES.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", _random_blocks(TYPES[name], rows, cols, rng),
                              raw_dtype=TYPES[name])
        for name, width in NORMS.items():  # llama.cpp's files hold 1 + w
            writer.add_tensor(f"blk.{i}.{name}.weight", rng.uniform(0.5, 1.5, width).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gemma3-ggml") / "tiny-gemma3.gguf")
    _write_gemma3(path)
    return path


def _generate(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5, detokenize=False)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]


def test_fused_decode_equals_layer_by_layer_bit_for_bit(gemma3_gguf, monkeypatch):
    # no prefix caching: the second pass must prefill the prompts exactly as the first
    llm = LLM(gemma3_gguf, dtype="float32", kv_cache_memory_gib=0.02, skip_tokenizer_init=True, max_model_len=256,
              enable_prefix_caching=False)
    model = llm.engine.model.model
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.ggml, GgmlStack) and isinstance(layer.mlp.gate_up_proj.ggml, GgmlStack)
    assert [layer.self_attn.attn.sliding_window for layer in model.layers] == [WINDOW, WINDOW, None]
    calls = []
    stack_call = cpu.gemma3_decode_stack
    monkeypatch.setattr(cpu, "gemma3_decode_stack", lambda x, *a: calls.append(x.shape[0]) or stack_call(x, *a))
    fused = _generate(llm)
    assert model.fused_decode and isinstance(model._decode_stack, Gemma3DecodeStack)
    assert calls and set(calls) == {len(PROMPTS)}  # every decode step, all three sequences in one call
    model.fused_decode, model._decode_stack, calls[:] = False, None, []
    layered = _generate(llm)
    assert not calls
    for f, ref in zip(fused, layered):
        assert f.token_ids == ref.token_ids
        assert [{k: v.logprob for k, v in lp.items()} for lp in f.logprobs] == \
            [{k: v.logprob for k, v in lp.items()} for lp in ref.logprobs]


def test_bf16_model_follows_within_its_rounding(gemma3_gguf):
    """A bf16 model's layer-by-layer path rounds every activation to bf16; the fused one keeps fp32."""
    llm = LLM(gemma3_gguf, dtype="bfloat16", kv_cache_memory_gib=0.02, skip_tokenizer_init=True, max_model_len=256,
              enable_prefix_caching=False)
    model = llm.engine.model.model
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=3, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    fused = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert isinstance(model._decode_stack, Gemma3DecodeStack)
    model.fused_decode, model._decode_stack = False, None
    layered = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for f, ref in zip(fused, layered):  # the first decode step's logprobs (the second token)
        ours, theirs = f.logprobs[1], ref.logprobs[1]
        shared = ours.keys() & theirs.keys()
        assert shared and max(abs(ours[k].logprob - theirs[k].logprob) for k in shared) < 0.1


def test_a_gemma3_with_dense_projections_is_not_supported(gemma3_gguf):
    dense = LLM(gemma3_gguf, dtype="float32", quantization="none", kv_cache_memory_gib=0.02,
                skip_tokenizer_init=True, max_model_len=256)
    assert not Gemma3DecodeStack.supports(dense.engine.model.model)


@pytest.mark.skipif(cpu_info().detected < CpuIsa.AVX2 or bool(os.environ.get("PRESSROOM_CPU_ISA")),
                    reason="the other tiers: on an AVX2 CPU, from the top-level run only")
# CI's AVX2 pass builds and runs the AVX2 tier itself: its build here runs with test-slow (the generic one too: 6 s)
@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx2", "generic"])
def test_other_tiers_builds(tier, tmp_path):
    """The AVX2 build and the plain-C one, whatever this CPU's tier: the same bit-for-bit agreement."""
    env = {**os.environ, "PRESSROOM_CPU_ISA": tier, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, f"--basetemp={tmp_path}",
            "-k", "bit_for_bit"]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]
