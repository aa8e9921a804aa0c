"""Kimi Linear against HF transformers (fp32, tiny random weights): the KDA layer over packed steps that mix
prefill chunks and decodes, and the whole model's greedy tokens and prompt logprobs through `LLM`."""
from __future__ import annotations

import pytest
import torch

from pressroom.attention.backend import AttentionMetadata, forward_context
from pressroom.attention.state import StateMetadata

NUM_SLOTS = 5
VOCAB = 4096  # ids the tokenizer saved beside the checkpoint (SmolLM2's) also knows


def kimi_config(**overrides):
    """Layers: KDA, MLA, KDA, KDA; layer 0 dense, then MoE (6 experts in 2 groups, top-2, a shared expert)."""
    import transformers
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                 q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_experts=6,
                 num_experts_per_token=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, linear_head_dim=16,
                 linear_num_heads=4, linear_conv_kernel_dim=4, first_k_dense_replace=1, initializer_range=0.2,
                 layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                 pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return transformers.KimiLinearConfig(**(shape | overrides))


def save_tiny_kimi(path, config, seed: int = 1234):
    """A tiny random HF checkpoint (the original checkpoints' tensor names, as save_pretrained writes them) with a
    correction bias that steers the routers; returns the HF model."""
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.rand(buffer.shape) * 0.5)
    model.save_pretrained(path)
    return model.eval()


def load_ours(weights: dict[str, torch.Tensor], config):
    from pressroom.model.models.kimi_linear import KimiLinearForCausalLM
    model = KimiLinearForCausalLM(config)
    loaded = model.load_weights(weights.items())
    assert model.expected_weights() == loaded
    return model.eval()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from safetensors.torch import load_file
    config = kimi_config()
    path = tmp_path_factory.mktemp("tiny-kimi")
    hf_model = save_tiny_kimi(path, config)
    return hf_model, load_ours(load_file(path / "model.safetensors"), config), path


def test_moonshot_checkpoint_names_load_the_same(tiny_pair):
    """Moonshot's checkpoints name the dense layer's MLP `mlp` (HF's save_pretrained writes `block_sparse_moe` for
    every layer) and fla's KDA keeps A_log as (heads,): such a checkpoint fills every parameter the same."""
    from safetensors.torch import load_file
    _, ours, path = tiny_pair
    weights = {name.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): t.flatten() if name.endswith("A_log")
               else t for name, t in load_file(path / "model.safetensors").items()}
    assert "model.layers.0.mlp.gate_proj.weight" in weights
    other = load_ours(weights, kimi_config())
    for (name, a), (_, b) in zip(ours.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def run_step(layer, x: torch.Tensor, parts: list[tuple[int, int]], num_decodes: int) -> torch.Tensor:
    """One engine step of a recurrent layer: `parts` (slot, tokens) per request, decodes first."""
    qsl = [0]
    for _, n in parts:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(num_decodes=num_decodes, num_decode_tokens=num_decodes, slot_mapping=torch.empty(0),
                             block_tables=torch.empty(0), seq_lens=torch.empty(0), query_start_loc=qsl,
                             seq_lens_host=[], state=StateMetadata.one_round(qsl, [s for s, _ in parts], "cpu",
                                                                            num_decodes))
    with forward_context(meta), torch.no_grad():
        return layer(None, x)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_kda_layer_matches_hf_over_chunked_prefill_and_decodes(kernels, tiny_pair, monkeypatch):
    """Three requests (slots 3, 1, 4): prompts of 5, 70 and 150 tokens, the last prefilled over two steps (the
    second also decodes the others), then decodes. Each step's outputs equal HF's layer run over each whole
    sequence at once (no cache), so the states carried between steps are right. "triton": the CUDA path's
    kernels (Triton's interpreter where there is no GPU)."""
    if kernels == "triton":
        from pressroom.kernels import triton as triton_kernels
        from pressroom.model.layers import state
        if torch.cuda.is_available() or not triton_kernels.interpreting():
            pytest.skip("checks the CUDA path's kernels on CPU tensors, under Triton's interpreter")
        monkeypatch.setattr(state, "on_triton", lambda x: True)
    hf_model, ours, _ = tiny_pair
    hf_layer, layer = hf_model.model.layers[0].self_attn, ours.model.layers[0].self_attn
    layer.bind_states({name: torch.zeros(NUM_SLOTS, *s.shape, dtype=s.dtype)
                       for name, s in layer.state_shapes().items()})
    lengths, slots = [7, 72, 152], [3, 1, 4]
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randn(n, 64, generator=gen) for n in lengths]
    with torch.no_grad():
        expected = [hf_layer(s.unsqueeze(0))[0] for s in seqs]
    # (request, first token, tokens) per step, decodes first
    steps = [[(0, 0, 5), (1, 0, 70), (2, 0, 100)],
             [(0, 5, 1), (1, 70, 1), (2, 100, 50)],
             [(0, 6, 1), (1, 71, 1), (2, 150, 1)],
             [(2, 151, 1)]]
    for step in steps:
        decodes = sum(1 for _, start, n in step if n == 1 and start > 0)
        x = torch.cat([seqs[i][start:start + n] for i, start, n in step])
        out = run_step(layer, x, [(slots[i], n) for i, _, n in step], decodes)
        want = torch.cat([expected[i][start:start + n] for i, start, n in step])
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def run_model_step(model, tokens: list[torch.Tensor], starts: list[int], slots: list[int], num_decodes: int,
                   block_size: int = 16) -> torch.Tensor:
    """One engine step of the whole model, caches bound by the caller: request i feeds `tokens[i]` from position
    `starts[i]`; request i's KV blocks are [i * 16, (i + 1) * 16). Returns the logits of every token."""
    qsl, positions, slot_mapping = [0], [], []
    for i, (t, start) in enumerate(zip(tokens, starts)):
        qsl.append(qsl[-1] + len(t))
        pos = torch.arange(start, start + len(t))
        positions.append(pos)
        slot_mapping.append((i * 16 + pos // block_size) * block_size + pos % block_size)
    lens = [start + len(t) for t, start in zip(tokens, starts)]
    meta = AttentionMetadata(num_decodes=num_decodes, num_decode_tokens=num_decodes,
                             slot_mapping=torch.cat(slot_mapping), seq_lens=torch.tensor(lens),
                             block_tables=torch.arange(16 * len(tokens)).view(len(tokens), 16),
                             query_start_loc=qsl, seq_lens_host=lens,
                             state=StateMetadata.one_round(qsl, slots, "cpu", num_decodes))
    with forward_context(meta), torch.no_grad():
        return model.compute_logits(model(torch.cat(tokens), torch.cat(positions)))


def bind_caches(model, block_size: int = 16) -> None:
    from pressroom.attention.torch_ref import TorchAttentionBackend
    from pressroom.model.layers.attention import Attention
    from pressroom.model.layers.state import RecurrentLayer
    for module in model.modules():
        if isinstance(module, Attention):
            module.kv_cache = torch.zeros(module.cache_shape(64, block_size))
            module.backend = TorchAttentionBackend()
        elif isinstance(module, RecurrentLayer):
            module.bind_states({name: torch.zeros(NUM_SLOTS, *s.shape, dtype=s.dtype)
                                for name, s in module.state_shapes().items()})


def test_whole_model_logits_match_hf_over_prefill_and_decodes(tiny_pair):
    """Two prompts (30 and 100 tokens) prefilled in one step, then three decode steps: every token's logits
    equal HF's forward over the whole sequences (KDA states, the NoPE MLA's latent cache and the MoE)."""
    hf_model, ours, _ = tiny_pair
    bind_caches(ours)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(100, VOCAB, (n,), generator=gen) for n in (33, 103)]
    with torch.no_grad():
        expected = [hf_model(s.unsqueeze(0)).logits[0] for s in seqs]
    got = run_model_step(ours, [seqs[0][:30], seqs[1][:100]], [0, 0], [2, 4], 0)
    torch.testing.assert_close(got, torch.cat([expected[0][:30], expected[1][:100]]), atol=1e-4, rtol=1e-4)
    for pos in range(3):
        got = run_model_step(ours, [seqs[0][30 + pos:31 + pos], seqs[1][100 + pos:101 + pos]], [30 + pos, 100 + pos],
                             [2, 4], 2)
        torch.testing.assert_close(got, torch.stack([expected[0][30 + pos], expected[1][100 + pos]]),
                                   atol=1e-4, rtol=1e-4)


GREEDY_TOKENS = 64


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, VOCAB - 100, (n,), generator=gen).tolist() for n in lengths]


def check_llm_against_hf(tiny_pair, tokenizer, batches: list[list[list[int]]], **engine_args) -> list:
    """Each batch of prompts generated in turn by one LLM: greedy tokens equal HF's, and prompt logprobs within
    1e-3 in the first batch (asking for them turns prefix-cache hits off, so the later batches do not).
    Returns the outputs, batch after batch."""
    from conftest import hf_greedy, hf_prompt_logprobs

    from pressroom import LLM, SamplingParams
    hf_model, _, path = tiny_pair
    tokenizer.save_pretrained(path)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gib=0.05, **engine_args)
    results = []
    for i, prompts in enumerate(batches):
        params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True,
                                prompt_logprobs=0 if i == 0 else None)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, GREEDY_TOKENS)
            if i == 0:
                ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
                theirs = hf_prompt_logprobs(hf_model, prompt)
                assert len(ours) == len(theirs) == len(prompt) - 1
                assert max((abs(a - b) for a, b in zip(ours, theirs)), default=0.0) < 1e-3
        results += outs
    return results


def test_llm_matches_hf(tiny_pair, smollm_tokenizer):
    """A 5- and a 150-token prompt: the long one prefills over three 64-token engine steps (each of one or more
    delta-rule chunks), its later chunks beside the short one's decodes."""
    check_llm_against_hf(tiny_pair, smollm_tokenizer, [prompts_of([5, 150], seed=0)], max_num_batched_tokens=64)


@pytest.mark.slow
def test_llm_matches_hf_long_and_shared_prompts(tiny_pair, smollm_tokenizer):
    """More and longer prompts (1 token up to five engine chunks) in small steps with few sequences at once; then
    two prompts that extend an earlier 130-token one, served from its KDA state checkpoint at 128 tokens."""
    prompts = prompts_of([1, 2, 64, 65, 300, 130, 17], seed=1)
    shared = prompts[5]
    extended = [shared + prompts_of([20], seed=2)[0], shared + prompts_of([41], seed=3)[0]]
    outs = check_llm_against_hf(tiny_pair, smollm_tokenizer, [prompts, extended], max_num_batched_tokens=64,
                                max_num_seqs=4)
    assert [o.num_cached_tokens for o in outs[-2:]] == [128, 128]


@pytest.mark.slow
def test_llm_runs_in_bf16_on_the_cpu(tiny_pair, smollm_tokenizer):
    """bf16 weights and conv states, fp32 delta-rule states (and, as HF keeps them, fp32 dt_bias, A_log and
    router): the prompt logprobs stray from HF's fp32 ones about as far as HF's own bf16 run does (the tiny random
    model's logits are large, so bf16 rounding shows; 0.089 against HF's 0.083 when written)."""
    import transformers
    from conftest import hf_prompt_logprobs

    from pressroom import LLM, SamplingParams
    hf_model, _, path = tiny_pair
    smollm_tokenizer.save_pretrained(path)
    prompts = prompts_of([9, 140], seed=4)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory_gib=0.05, max_num_batched_tokens=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = [next(iter(pos.values())).logprob for o in outs for pos in o.prompt_logprobs[1:]]
    layer = llm.engine.model.model.layers[0].self_attn
    assert layer.states["conv"].dtype == torch.bfloat16 and layer.states["recurrent"].dtype == torch.float32
    assert layer.dt_bias.dtype == layer.A_log.dtype == llm.engine.model.model.layers[1].mlp.gate.weight.dtype
    assert layer.dt_bias.dtype == torch.float32
    hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf = {name: [lp for p in prompts for lp in hf_prompt_logprobs(model, p)]
          for name, model in (("fp32", hf_model), ("bf16", hf_bf16))}

    def mean_gap(a: list[float], b: list[float]) -> float:
        assert len(a) == len(b) == 8 + 139
        return sum(abs(x - y) for x, y in zip(a, b)) / len(a)
    assert 0 < mean_gap(ours, hf["fp32"]) < 1.25 * mean_gap(hf["bf16"], hf["fp32"])
