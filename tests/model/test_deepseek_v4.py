"""DeepSeek-V4 against HF transformers (fp32, tiny random weights): every attention layer type (sliding window,
CSA with its lightning indexer, HCA), hash and sqrt-softplus routed MoE layers and hyper-connections, through
`LLM` with chunked prefill, decodes beside prefills and prefix-cache hits; the compressed cache's paging; and
checkpoints with a missing or misshaped tensor."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pressroom.model.layers.compressed_kv import CompressedKVCache

WINDOW, CSA_RATE, HCA_RATE, TOPK = 12, 4, 8, 5
TINY = dict(vocab_size=49152, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            head_dim=32, partial_rotary_factor=0.25, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=4,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"],
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": CSA_RATE, "heavily_compressed_attention": HCA_RATE},
            hc_mult=3, hc_sinkhorn_iters=6, sliding_window=WINDOW, o_groups=2, o_lora_rank=16,
            # 16 indexer heads: with few, an entry's score is often exactly 0 (every head's relu zero), and which
            # tied entry a top-k keeps is up to the implementation
            index_n_heads=16, index_head_dim=16, index_topk=TOPK, max_position_embeddings=2048,
            initializer_range=0.2, num_nextn_predict_layers=0, tie_word_embeddings=False)
GREEDY_TOKENS = 64


def randomize_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Every parameter and buffer random: HF's init leaves sinks, position biases, hyper-connection biases and
    scales, correction biases and the hash table at 0 or 1."""
    experts, top_k = TINY["n_routed_experts"], TINY["num_experts_per_tok"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("scale"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("sinks", "position_bias", "base")):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):  # distinct experts per token
                b.copy_(torch.rand(b.shape[0], experts, generator=gen).argsort(dim=1)[:, :top_k])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=gen) * 0.5)


def save_tiny(path: Path, tokenizer, seed: int = 0) -> None:
    import transformers
    model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV4Config(**TINY),
                                                          dtype=torch.float32)
    randomize_(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory, smollm_tokenizer) -> str:
    path = tmp_path_factory.mktemp("tiny-deepseek-v4")
    save_tiny(path, smollm_tokenizer)
    return str(path)


@torch.inference_mode()
def hf_greedy_recomputed(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens with the whole sequence recomputed at each step (no HF cache: its compressor state is
    the part under test)."""
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, TINY["vocab_size"] - 100, (n,), generator=gen).tolist() for n in lengths]


def test_tiny_model_matches_hf(tiny_v4):
    import transformers
    from conftest import hf_prompt_logprobs

    from pressroom import LLM, SamplingParams
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_v4, dtype=torch.float32)
    prompts = prompts_of([5, 11, 40, 150], seed=0)
    llm = LLM(tiny_v4, dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
        theirs = hf_prompt_logprobs(hf_model, prompt)
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-3
        assert out.outputs[0].token_ids == hf_greedy_recomputed(hf_model, prompt, GREEDY_TOKENS)
