"""A tiny llama GGUF whose projections come in Q5_0, Q8_0, Q4_K, Q5_K and Q6_K (random blocks) and whose tied
embedding is Q8_0: on the CPU every projection is kept in its GGML form (no dense copy), each loads to exactly
the dequantized weight, and prompt logprobs stay within activation rounding of the dequantized fp32 twin
(quantization="none"). The kernels' own exactness is tests/kernels/test_ggml_ops.py's."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pressroom import LLM, SamplingParams
from pressroom.model.gguf_file import iter_gguf_weights
from pressroom.model.layers.quant import GgmlStack, KWeight, Q5Weight, Q6KWeight, Q8Weight

T = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 256, 4, 2, 512, 320, 2
HEAD_DIM = HIDDEN // HEADS
TYPES = {"attn_q": T.Q5_0, "attn_k": T.Q5_0, "attn_v": T.Q8_0, "attn_output": T.Q4_K, "ffn_gate": T.Q5_K,
         "ffn_up": T.Q5_0, "ffn_down": T.Q6_K}
F16_AT = {T.Q8_0: (0,), T.Q5_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
# nats, mean and worst over 65 positions: activations rounded to int8 per block (llama.cpp's arithmetic) against
# fp32 ones move each layer's output by ~0.7% on this random model (measured 0.039 and 0.42)
MEAN_GAP, MAX_GAP = 0.06, 0.6


def _random_blocks(ggml_type: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if ggml_type == T.Q8_0:
        raw[..., 2:] = np.where(raw[..., 2:] == 128, 129, raw[..., 2:])
    for at in F16_AT[ggml_type]:
        raw[..., at:at + 2] = rng.uniform(5e-4, 4e-3, (rows, cols // block, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ggml-forms") / "tiny.gguf")
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in [(writer.add_block_count, LAYERS), (writer.add_context_length, 256),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, FFN),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_rope_freq_base, 10000.0),
                       (writer.add_bos_token_id, 1), (writer.add_eos_token_id, 2)]:
        add(value)
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN),
              "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    embd = _random_blocks(T.Q8_0, VOCAB, HIDDEN, rng)
    embd.reshape(VOCAB, -1, 34)[..., :2] = np.full((VOCAB, HIDDEN // 32, 1), 2e-3, np.float16).view(np.uint8)
    writer.add_tensor("token_embd.weight", embd, raw_dtype=T.Q8_0)
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    for i in range(LAYERS):
        for name, (rows, cols) in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", _random_blocks(TYPES[name], rows, cols, rng),
                              raw_dtype=TYPES[name])
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_each_type_loads_as_its_form_and_dequantizes_exactly(tiny_gguf):
    dense = {name: w.load() for name, w in iter_gguf_weights(tiny_gguf)}
    kept = {name: w.load() for name, w in iter_gguf_weights(tiny_gguf, keep_4bit=True)}
    expected = {"q_proj": Q5Weight, "k_proj": Q5Weight, "v_proj": Q8Weight, "o_proj": KWeight, "gate_proj": KWeight,
                "up_proj": Q5Weight, "down_proj": Q6KWeight}
    for name, weight in kept.items():
        if name.endswith("_proj.weight"):
            assert isinstance(weight, expected[name.split(".")[-2]]), name
        if not name.endswith("norm.weight"):  # q_proj / k_proj rows are unpermuted in both forms alike
            assert torch.equal(weight.dequantize(), dense[name]), name


def test_model_keeps_ggml_forms_and_follows_its_dequantized_twin(tiny_gguf):
    kwargs = dict(dtype="float32", kv_cache_memory_gib=0.02, skip_tokenizer_init=True, max_model_len=256)
    quantized = LLM(tiny_gguf, **kwargs)
    layer = quantized.engine.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.ggml, GgmlStack)  # Q5_0 q and k, then Q8_0 v
    assert isinstance(layer.mlp.down_proj.ggml, Q6KWeight) and layer.mlp.down_proj.weight.numel() == 0
    assert quantized.engine.model.lm_head.q8 is not None
    twin = LLM(tiny_gguf, quantization="none", **kwargs)
    assert twin.engine.model.model.layers[0].mlp.down_proj.ggml is None
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False)

    def logprobs(llm: LLM) -> list[list[float]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[next(iter(pos.values())).logprob for pos in o.prompt_logprobs[1:]] for o in outs]
    ours, theirs = logprobs(quantized), logprobs(twin)
    gaps = [abs(a - b) for row_a, row_b in zip(ours, theirs) for a, b in zip(row_a, row_b)]
    assert sum(gaps) / len(gaps) < MEAN_GAP and max(gaps) < MAX_GAP
    assert max(gaps) > 1e-6  # and the kernels' rounding is really there
