"""Qwen3-Next against HF transformers (fp32, tiny random weights): the Gated DeltaNet layer over packed steps
(chunked prefill continued across steps, decodes mixed with prefills; torch, Triton and GPU kernels), and the
whole model through `LLM`: greedy tokens and prompt logprobs, a prefix hit served from a state checkpoint, bf16,
and two tensor-parallel ranks (the last three slow)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pressroom.attention.backend import AttentionMetadata, forward_context
from pressroom.attention.state import StateMetadata
from pressroom.model.models.qwen3_next import GatedDeltaNet

NUM_SLOTS = 6  # state slots bound in the layer tests (slot 0: padding, never used)

# layer 1 and 3 full attention; GQA in both kinds of layer (2 key heads for 4 value heads)
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            full_attention_interval=2, mlp_only_layers=[2], max_position_embeddings=2048,
            initializer_range=0.2, tie_word_embeddings=False)


def tiny_config():
    import transformers
    return transformers.Qwen3NextConfig(**TINY)


def randomize_(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Every parameter random and O(1)-scaled, so decays, betas and norm weights all differ per head."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
            elif name.endswith("norm.weight") or name.endswith("dt_bias"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def gdn_pair(seed: int = 0, device: str = "cpu"):
    """HF's Qwen3NextGatedDeltaNet (on the CPU) and ours on the same weights, on `device`, our states bound to
    `NUM_SLOTS` slots."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    config = tiny_config()
    gen = torch.Generator().manual_seed(seed)
    hf = Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    randomize_(hf, gen)
    ours = GatedDeltaNet(config)
    with torch.no_grad():
        w = ours.in_proj.weight
        w.weight_loader(w, hf.in_proj_qkvz.weight, "qkvz")
        w.weight_loader(w, hf.in_proj_ba.weight, "ba")
        for name in ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"):
            ours.get_parameter(name).copy_(hf.get_parameter(name))
    ours.to(device)
    ours.bind_states({name: torch.zeros(NUM_SLOTS, *s.shape, dtype=s.dtype, device=device)
                      for name, s in ours.state_shapes().items()})
    return hf, ours


def run_step(layer: GatedDeltaNet, parts: list[tuple[int, torch.Tensor]], num_decodes: int,
             device: str = "cpu") -> list[torch.Tensor]:
    """One engine step on `device`: `parts` (state slot, tokens [n, hidden]) packed, decodes first; the outputs
    per part (on the CPU)."""
    qsl = [0]
    for _, x in parts:
        qsl.append(qsl[-1] + x.shape[0])
    meta = AttentionMetadata(num_decodes=num_decodes, num_decode_tokens=num_decodes, slot_mapping=torch.empty(0),
                             block_tables=torch.empty(0), seq_lens=torch.empty(0), query_start_loc=qsl,
                             seq_lens_host=[],
                             state=StateMetadata.one_round(qsl, [s for s, _ in parts], device, num_decodes))
    with forward_context(meta), torch.no_grad():
        out = layer(torch.cat([x for _, x in parts]).to(device)).cpu()
    return [out[a:b] for a, b in zip(qsl[:-1], qsl[1:])]


@pytest.mark.parametrize("kernels", ["torch", "triton", "cuda"])
def test_gated_deltanet_equals_hf_over_packed_steps(kernels, monkeypatch):
    """Four sequences through prefill chunks and decodes: A's 153 tokens prefilled over two steps (two delta-rule
    chunks in the first), B and C decoding beside A's second part and D's whole prompt, then decodes only.
    Every output equals HF's layer run on each whole sequence at once (no cache): the conv and delta-rule states
    carry exactly across steps, and slot 0 (padding) is never touched. "triton": the CUDA path's kernels
    (Triton's interpreter where there is no GPU); "cuda": the layer on a GPU."""
    if kernels == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if kernels == "triton":
        from pressroom.kernels import triton as triton_kernels
        from pressroom.model.layers import state
        if torch.cuda.is_available() or not triton_kernels.interpreting():
            pytest.skip("checks the CUDA path's kernels on CPU tensors, under Triton's interpreter")
        monkeypatch.setattr(state, "on_triton", lambda x: True)
    device = "cuda" if kernels == "cuda" else "cpu"
    hf, ours = gdn_pair(device=device)
    gen = torch.Generator().manual_seed(1)
    lengths = {"A": 150 + 3, "B": 7 + 5, "C": 1 + 5, "D": 40 + 3}
    seqs = {n: torch.randn(k, TINY["hidden_size"], generator=gen) for n, k in lengths.items()}
    slot = {"A": 3, "B": 1, "C": 5, "D": 2}
    got: dict[str, list[torch.Tensor]] = {n: [] for n in seqs}
    pos = dict.fromkeys(seqs, 0)

    def step(plan: list[tuple[str, int]], num_decodes: int) -> None:
        parts = [(slot[n], seqs[n][pos[n]:pos[n] + k]) for n, k in plan]
        for (n, k), out in zip(plan, run_step(ours, parts, num_decodes, device)):
            got[n].append(out)
            pos[n] += k

    step([("A", 100), ("B", 7), ("C", 1)], 0)
    step([("B", 1), ("C", 1), ("A", 50), ("D", 40)], 2)
    for _ in range(3):
        step([(n, 1) for n in ("A", "B", "C", "D")], 4)
    step([("B", 1), ("C", 1)], 2)

    assert pos == lengths
    tol = 1e-4 if device == "cuda" else 2e-5  # the GPU's reductions run in another order
    with torch.no_grad():
        for n, x in seqs.items():
            torch.testing.assert_close(torch.cat(got[n]), hf(x[None])[0], atol=tol, rtol=tol)
    assert not ours.states["conv"][0].any() and not ours.states["ssm"][0].any()


def test_in_proj_rows_reordered_to_contiguous_qkvzba():
    """The checkpoint's per-key-head groups become [q | k | v | z | b | a]: each row of our projection is the
    HF row that fix_query_key_value_ordering routes to that place."""
    hf, ours = gdn_pair(seed=3)
    x = torch.randn(5, TINY["hidden_size"])
    with torch.no_grad():
        q, k, v, z, b, a = hf.fix_query_key_value_ordering(hf.in_proj_qkvz(x[None]), hf.in_proj_ba(x[None]))
        expected = torch.cat([t[0].flatten(1) for t in (q, k, v, z)] + [b[0], a[0]], dim=-1)
        torch.testing.assert_close(ours.in_proj(x), expected)


# ---------------------------------------------------------------- the whole model through LLM

GREEDY_TOKENS = 64


@pytest.fixture(scope="module")
def tiny_qwen3_next(tmp_path_factory, smollm_tokenizer) -> str:
    """A tiny random Qwen3-Next checkpoint: two GDN and two gated-attention layers, MoE on layers 0, 1 and 3,
    norm weights random (HF initialises the (1 + w) ones at zero, which would hide a missing + 1)."""
    import transformers
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape))
    path = tmp_path_factory.mktemp("tiny-qwen3-next")
    model.save_pretrained(path)
    smollm_tokenizer.save_pretrained(path)
    as_released(path)
    return str(path)


def as_released(path: Path) -> None:
    """The checkpoint in the released models' form: the multi-token-prediction head's tensors beside the model's
    (unused, skipped on load), and a config.json with full_attention_interval, rope_theta and
    partial_rotary_factor in place of layer_types and rope_parameters."""
    from safetensors.torch import load_file, save_file
    weights = load_file(path / "model.safetensors")
    hidden = TINY["hidden_size"]
    weights |= {"mtp.fc.weight": torch.randn(hidden, 2 * hidden), "mtp.norm.weight": torch.zeros(hidden)}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    assert config.pop("layer_types") == ["linear_attention", "full_attention"] * 2
    rope = config.pop("rope_parameters")
    config.update(full_attention_interval=2, rope_theta=rope["rope_theta"],
                  partial_rotary_factor=rope["partial_rotary_factor"])
    (path / "config.json").write_text(json.dumps(config))


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, TINY["vocab_size"] - 100, (n,), generator=gen).tolist() for n in lengths]


def check_against_hf(path: str, batches: list[list[list[int]]], **engine_args) -> list:
    """Each batch of prompts generated in turn by one LLM: greedy tokens equal HF's, and prompt logprobs within
    1e-3 in the first batch (asking for them turns prefix-cache hits off, so the later batches do not).
    Returns the outputs, batch after batch."""
    import transformers
    from conftest import hf_greedy, hf_prompt_logprobs

    from pressroom import LLM, SamplingParams
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05, **engine_args)
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


def test_tiny_model_matches_hf(tiny_qwen3_next):
    """Mixed prompt lengths, one of them over several 64-token engine chunks and delta-rule chunks; later
    chunks of a prompt run beside other requests' decodes."""
    check_against_hf(tiny_qwen3_next, [prompts_of([5, 37, 150], seed=0)], max_num_batched_tokens=64)


@pytest.mark.slow
def test_tiny_model_matches_hf_long_and_shared_prompts(tiny_qwen3_next):
    """More and longer prompts (1 token up to five engine chunks) in small steps with few sequences at once;
    then two prompts that extend an earlier 130-token one, served from its state checkpoint at 128 tokens."""
    prompts = prompts_of([1, 2, 64, 65, 300, 130, 17], seed=1)
    shared = prompts[5]
    extended = [shared + prompts_of([20], seed=2)[0], shared + prompts_of([41], seed=3)[0]]
    outs = check_against_hf(tiny_qwen3_next, [prompts, extended], max_num_batched_tokens=64, max_num_seqs=4)
    assert [o.num_cached_tokens for o in outs[-2:]] == [128, 128]


@pytest.mark.slow
def test_tiny_model_runs_in_bf16_on_the_cpu(tiny_qwen3_next):
    """bf16 weights and conv states, fp32 delta-rule states: the prompt logprobs stray from HF's fp32 ones about
    as far as HF's own bf16 run does (the tiny random model's logits are large, so bf16 rounding shows). Ours
    stray twice as far: the (1 + w) norm weights are held as bf16(1 + w), where HF multiplies by 1 + w in fp32;
    rounding HF's weights so accounts for most of it (0.108 of our 0.125 against HF's 0.061)."""
    import transformers
    from conftest import hf_prompt_logprobs

    from pressroom import LLM, SamplingParams
    prompts = prompts_of([9, 140], seed=4)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    llm = LLM(tiny_qwen3_next, dtype="bfloat16", kv_cache_memory_gib=0.05, max_num_batched_tokens=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = [next(iter(pos.values())).logprob for o in outs for pos in o.prompt_logprobs[1:]]
    layer = llm.engine.model.model.layers[0].linear_attn
    assert layer.states["conv"].dtype == torch.bfloat16 and layer.states["ssm"].dtype == torch.float32
    hf = {dtype: [lp for p in prompts for lp in hf_prompt_logprobs(
        transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3_next, dtype=dtype), p)]
        for dtype in (torch.float32, torch.bfloat16)}

    def mean_gap(a: list[float], b: list[float]) -> float:
        assert len(a) == len(b) == 8 + 139
        return sum(abs(x - y) for x, y in zip(a, b)) / len(a)
    assert 0 < mean_gap(ours, hf[torch.float32]) < 2.5 * mean_gap(hf[torch.bfloat16], hf[torch.float32])


@pytest.mark.slow  # two gloo worker processes on the CPU
def test_two_ranks_give_the_tokens_of_one(tiny_qwen3_next):
    """Tensor parallelism over two ranks: each holds one of the two key heads (with its value heads) of every GDN
    layer, two of the four attention heads, half of every expert; greedy tokens equal one rank's."""
    from pressroom import LLM, SamplingParams
    prompts = [{"prompt_token_ids": p} for p in prompts_of([6, 90, 33], seed=5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    tokens, counts = {}, {}
    for tp in (1, 2):
        llm = LLM(tiny_qwen3_next, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory_gib=0.05,
                  max_num_batched_tokens=64, tensor_parallel_size=tp)
        try:
            tokens[tp] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            counts[tp] = llm.engine.core.executor.collective_rpc("parameter_count")
        finally:
            llm.shutdown()
    assert tokens[2] == tokens[1]
    (whole,) = counts[1]  # each rank holds about half: norms and routers are replicated
    assert all(0.45 * whole < c < 0.55 * whole for c in counts[2]) and sum(counts[2]) >= whole, (counts, whole)


def test_online_fp8_quantizes_the_reordered_rows(tiny_qwen3_next):
    """--quantization fp8 on the fp32 checkpoint: the stacked GDN and attention projections hold exactly the fp8
    quantization of the checkpoint's rows in our order (reordered [q | k | v | z | b | a]; [q+gate | k | v])."""
    import transformers
    from safetensors.torch import load_file

    from pressroom import LLM
    from pressroom.kernels import fp8
    from pressroom.model.models.qwen3_next import GdnShape, reorder_ba, reorder_qkvz
    shape = GdnShape.of(transformers.AutoConfig.from_pretrained(tiny_qwen3_next))
    shipped = load_file(f"{tiny_qwen3_next}/model.safetensors")
    llm = LLM(tiny_qwen3_next, dtype="float32", kv_cache_memory_gib=0.05, quantization="fp8")
    layers = llm.engine.model.model.layers
    gdn = "model.layers.0.linear_attn."
    expected = {layers[0].linear_attn.in_proj: torch.cat((reorder_qkvz(shipped[gdn + "in_proj_qkvz.weight"], shape),
                                                          reorder_ba(shipped[gdn + "in_proj_ba.weight"], shape))),
                layers[1].self_attn.qkv_proj: torch.cat([shipped[f"model.layers.1.self_attn.{n}_proj.weight"]
                                                         for n in "qkv"])}
    for linear, rows in expected.items():
        assert linear.weight.dtype == fp8.FP8
        assert torch.equal(linear.quant_method.dequantized(linear), fp8.dequantize(*fp8.quantize(rows, 128), 128))
