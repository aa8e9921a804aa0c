"""DeepSeek-V4 against HF transformers (fp32, tiny random weights): every attention layer type (sliding window,
CSA with its lightning indexer, HCA), hash and sqrt-softplus routed MoE layers and hyper-connections, through
`LLM` with chunked prefill, decodes beside prefills and prefix-cache hits; the compressed cache's paging; and
checkpoints with a missing or misshaped tensor."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from pressroom.model.layers.compressed_kv import CompressedKVCache

WINDOW, CSA_RATE, HCA_RATE, TOPK = 12, 4, 16, 5
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


def save_tiny(path: Path, tokenizer, seed: int = 0, **overrides) -> None:
    """`tokenizer` None: weights and config only (the engine runs with skip_tokenizer_init)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV4Config(**TINY | overrides),
                                                          dtype=torch.float32)
    randomize_(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory, smollm_tokenizer) -> str:
    path = tmp_path_factory.mktemp("tiny-deepseek-v4")
    save_tiny(path, smollm_tokenizer)
    return str(path)


@torch.inference_mode()
def hf_log_softmax(model, ids: list[int]) -> torch.Tensor:
    """HF's log-probabilities after each token of `ids`, from one forward pass without a cache ([len, vocab])."""
    return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def check_against_hf(hf_model, prompt: list[int], out, with_prompt_logprobs: bool) -> None:
    """Greedy tokens: HF's choice after the prompt and each of our tokens, all in one forward pass over the whole
    sequence with no cache (HF's causal forward gives each position what recomputing up to it would: the same
    oracle as recomputing the sequence at every step, at the cost of one pass). Prompt logprobs within 1e-3."""
    tokens = list(out.outputs[0].token_ids)
    assert len(tokens) == GREEDY_TOKENS
    logprobs = hf_log_softmax(hf_model, prompt + tokens[:-1])
    assert logprobs[len(prompt) - 1:].argmax(dim=-1).tolist() == tokens
    if with_prompt_logprobs:
        ours = torch.tensor([next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]])
        theirs = logprobs[:len(prompt) - 1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
        assert out.prompt_logprobs[0] is None
        assert len(ours) == len(prompt) - 1
        assert torch.all((ours - theirs).abs() < 1e-3)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, TINY["vocab_size"] - 100, (n,), generator=gen).tolist() for n in lengths]


def run_batches(path: str, batches: list[list[list[int]]], **engine_args) -> tuple[list, object]:
    """Each batch generated in turn by one LLM and checked against HF; prompt logprobs in the first batch only
    (asking for them turns prefix-cache hits off). Returns the outputs, batch after batch, and the LLM."""
    import transformers

    from pressroom import LLM, SamplingParams
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05, **engine_args)
    results = []
    for i, prompts in enumerate(batches):
        params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True,
                                prompt_logprobs=0 if i == 0 else None)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            check_against_hf(hf_model, prompt, out, i == 0)
        results += outs
    return results, llm


def test_compressed_cache_pages_entries_through_the_block_table():
    """Entry w lives in the block of its window's last token: several per block (rate 4, blocks of 16), or one
    slot per block used by the block that closes the window (rate 32); rates and blocks that do not divide one
    another are refused."""
    table = torch.tensor([5, 2, 9, 7])
    small = CompressedKVCache(3, 4)
    assert small.cache_shape(10, 16) == (1, 10, 4, 1, 3)
    assert small.entry_slots(table, 6, 16).tolist() == [20, 21, 22, 23, 8, 9]
    token_slots = table[torch.arange(24) // 16] * 16 + torch.arange(24) % 16
    assert small.slots_of_tokens(token_slots, 16)[3::4].tolist() == [20, 21, 22, 23, 8, 9]
    large = CompressedKVCache(3, 32)
    assert large.cache_shape(10, 16) == (1, 10, 1, 1, 3)
    assert large.entry_slots(table, 2, 16).tolist() == [2, 7]
    with pytest.raises(ValueError, match="divide"):
        CompressedKVCache(3, 12).cache_shape(10, 16)


def test_tiny_model_matches_hf(tiny_v4):
    """Prompts shorter than the window and far longer than it and than the indexer's top-k, prefilled in 45-token
    chunks beside other requests' decodes, over blocks of 8 (an HCA window spans two); then a prompt that extends
    the long one and the long one again, served from the prefix cache: compressor states restored from the
    checkpoint at 120 tokens, half-way through an HCA window."""
    prompts = prompts_of([5, 11, 40, 150], seed=0)
    extended = prompts[3] + prompts_of([21], seed=1)[0]
    outs, llm = run_batches(tiny_v4, [prompts, [extended, prompts[3]]], max_num_batched_tokens=45, block_size=8,
                            mamba_block_size=40)
    assert [o.num_cached_tokens for o in outs[-2:]] == [120, 120] and 120 % HCA_RATE
    assert outs[-1].outputs[0].token_ids == outs[3].outputs[0].token_ids
    # Paged blocks hold the compressed entries only (two CSA layers' 8 / 4 entries of values + indexer key, the HCA
    # layer's one slot); the window's K=V is a ring of WINDOW rows per layer and request (fp32: 4 bytes a value).
    spec, dim = llm.engine.core.model_spec, TINY["head_dim"]
    assert spec.kv_bytes_per_block == 4 * (2 * (8 // CSA_RATE) * (dim + TINY["index_head_dim"]) + dim)
    assert spec.state_bytes_per_slot > 4 * TINY["num_hidden_layers"] * WINDOW * dim


@pytest.mark.parametrize("fault", ["missing", "misshaped", "hash_table"])
def test_bad_checkpoint_names_the_tensor(fault, tiny_v4, tmp_path):
    """A tensor left out, one of the wrong shape, and a hash table pointing past the experts: each a ValueError
    that names the tensor (in HF's module naming; a misshaped one by its checkpoint name too)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pressroom import LLM
    for f in Path(tiny_v4).iterdir():
        shutil.copy(f, tmp_path / f.name)
    weights = load_file(tmp_path / "model.safetensors")
    if fault == "missing":
        del weights["model.layers.1.attn.indexer.compressor.wkv.weight"]
        named = "model.layers.1.self_attn.compressor.indexer.kv_proj.weight"
    elif fault == "misshaped":
        weights["model.layers.2.attn.wo_a.weight"] = torch.zeros(32, 65)
        named = "model.layers.2.attn.wo_a.weight"
    else:
        weights["model.layers.0.ffn.gate.tid2eid"][7, 1] = TINY["n_routed_experts"]
        named = "model.layers.0.mlp.gate.tid2eid"
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(named)):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory_gib=0.05)


@pytest.mark.slow
def test_tiny_model_matches_hf_yarn_wide_windows(tmp_path, smollm_tokenizer):
    """The compressed layers' YaRN rope, four hyper-connection streams, an HCA rate of 32 over blocks of 8 (a
    window spans four blocks) and a CSA rate of 8; prompts of 1 token up to several chunks in 30-token steps with
    three sequences at once, then prompts that extend two of them from the prefix cache."""
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 128, "beta_fast": 32,
            "beta_slow": 1}
    save_tiny(tmp_path, smollm_tokenizer, seed=3, rope_parameters=yarn, hc_mult=4, sliding_window=16,
              compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 32})
    prompts = prompts_of([1, 16, 17, 70, 260], seed=4)
    extended = [prompts[3] + prompts_of([9], seed=5)[0], prompts[4] + prompts_of([40], seed=6)[0]]
    outs, _ = run_batches(str(tmp_path), [prompts, extended], max_num_batched_tokens=30, max_num_seqs=3,
                          block_size=8, mamba_block_size=24)
    assert [o.num_cached_tokens for o in outs[-2:]] == [48, 240]  # both half-way through an HCA window


@pytest.mark.slow
def test_preempted_requests_recompute_to_hf_tokens(tiny_v4):
    """Sixty blocks of 8 for six requests that need up to 27 each: the scheduler preempts and recomputes (fresh
    compressor state, entries written again), and every request still gets HF's tokens."""
    _, llm = run_batches(tiny_v4, [prompts_of([5, 11, 40, 150, 90, 60], seed=7)], max_num_batched_tokens=45,
                         block_size=8, num_gpu_blocks_override=60)
    assert llm.engine.core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("raw, canonical", [
    ("embed.weight", "model.embed_tokens.weight"), ("head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"), ("hc_head_fn", "model.hc_head.hc_fn"),
    ("layers.3.hc_ffn_scale", "model.layers.3.ffn_hc.scale"),
    ("layers.2.attn.wq_b.weight", "model.layers.2.self_attn.q_b_proj.weight"),
    ("layers.2.attn.norm.weight", "model.layers.2.self_attn.kv_norm.weight"),
    ("layers.2.attn.indexer.wq_b.weight", "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight"),
    ("layers.2.attn.indexer.compressor.ape", "model.layers.2.self_attn.compressor.indexer.position_bias"),
    ("model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight",
     "model.layers.2.self_attn.compressor.indexer.weights_proj.weight"),
    ("layers.5.ffn.gate.bias", "model.layers.5.mlp.gate.e_score_correction_bias"),
    ("layers.5.ffn.shared_experts.w3.weight", "model.layers.5.mlp.shared_experts.up_proj.weight"),
])
def test_deepseek_checkpoint_names(raw, canonical):
    """DeepSeek's own names (no `model.` prefix, as its checkpoints ship) and HF's map onto the model's."""
    from pressroom.model.models.deepseek_v4 import canonical_name
    assert canonical_name(raw) == canonical


def test_hf_module_names_and_fused_experts_load_alike(tiny_v4):
    """The checkpoint as HF's save_pretrained writes it (DeepSeek's names, one tensor per expert) and as HF's
    modules name it (fused [experts, 2 * inter, hidden] gate_up): the same parameters and hash tables; MTP layers
    are skipped."""
    import transformers
    from safetensors.torch import load_file

    from pressroom.model.models.deepseek_v4 import DeepseekV4ForCausalLM
    config = transformers.AutoConfig.from_pretrained(tiny_v4)
    saved = load_file(Path(tiny_v4) / "model.safetensors")
    hf_named = transformers.AutoModelForCausalLM.from_pretrained(tiny_v4, dtype=torch.float32).state_dict()
    hf_named["mtp.0.ffn.gate.weight"] = torch.zeros(1)  # DeepSeek ships its MTP layer under mtp.*
    models = []
    for weights in (saved, hf_named):
        model = DeepseekV4ForCausalLM(config)
        assert model.load_weights(weights.items()) >= model.expected_weights()
        models.append(model)
    ours, theirs = (dict(m.state_dict()) for m in models)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
@pytest.mark.parametrize("tokens", [1, 9])
def test_triton_experts_take_the_limited_swiglu(tokens):
    """V4's experts (gate clamped above, up to +-limit, silu(gate) * up) in the Triton fused MoE kernel equal
    FusedMoE's torch path; the limit is small enough that the clamps decide the result."""
    from pressroom.kernels.moe_activation import LimitedSwiglu
    from pressroom.kernels.triton.fused_moe import fused_moe
    from pressroom.model.layers.fused_moe import FusedMoE
    gen = torch.Generator().manual_seed(tokens)
    hidden, inter, experts, top_k = 48, 40, 5, 2
    act = LimitedSwiglu(limit=0.7)
    layer = FusedMoE(experts, hidden, inter, activation=act)
    with torch.no_grad():
        layer.w13.copy_(torch.randn(layer.w13.shape, generator=gen))
        layer.w2.copy_(0.3 * torch.randn(layer.w2.shape, generator=gen))
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got = fused_moe(*(t.to(device) for t in (x, layer.w13.data, layer.w2.data, weights, ids)), activation=act)
    want = layer(x, weights, ids)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    unclamped = fused_moe(*(t.to(device) for t in (x, layer.w13.data, layer.w2.data, weights, ids)))
    assert (unclamped.cpu() - want).abs().max() > 0.1


@pytest.mark.slow
def test_tiny_model_matches_hf_on_the_cuda_path_kernels(tiny_v4, monkeypatch):
    """The CUDA path (Triton attention and indexer, the compressor's decodes on the device) on CPU tensors under
    Triton's interpreter: HF's greedy tokens and prompt logprobs, chunked prefill beside decodes, then prefix-cache
    hits."""
    from pressroom.kernels import triton as triton_kernels
    from pressroom.model.layers import state
    if torch.cuda.is_available() or not triton_kernels.interpreting():
        pytest.skip("checks the CUDA path's kernels on CPU tensors, under Triton's interpreter")
    from pressroom.kernels.triton import v4_attention
    from pressroom.model.models.deepseek_v4 import V4Compressor
    monkeypatch.setattr(state, "on_triton", lambda x: True)
    calls = {"attention": 0, "decodes": 0}

    def counted(name, f):
        def run(*args, **kwargs):
            calls[name] += 1
            return f(*args, **kwargs)
        return run

    monkeypatch.setattr(v4_attention, "v4_attention", counted("attention", v4_attention.v4_attention))
    monkeypatch.setattr(V4Compressor, "_decode_on_device", counted("decodes", V4Compressor._decode_on_device))
    prompts = prompts_of([5, 40, 150], seed=0)
    extended = prompts[2] + prompts_of([21], seed=1)[0]
    outs, _ = run_batches(tiny_v4, [prompts, [extended]], max_num_batched_tokens=45, block_size=8,
                          mamba_block_size=40)
    assert outs[-1].num_cached_tokens == 120
    assert calls["attention"] > 4 * GREEDY_TOKENS and calls["decodes"] > 3 * GREEDY_TOKENS


def _bound_model(path: str, slots: int, blocks: int, block_size: int):
    """Our model with HF's weights and caches bound as the runner binds them (torch backend for the CPU path)."""
    import transformers
    from safetensors.torch import load_file

    from pressroom.attention.torch_ref import TorchAttentionBackend
    from pressroom.model.layers.attention import Attention
    from pressroom.model.layers.state import RecurrentLayer
    from pressroom.model.models.deepseek_v4 import DeepseekV4ForCausalLM
    model = DeepseekV4ForCausalLM(transformers.AutoConfig.from_pretrained(path))
    model.load_weights(load_file(Path(path) / "model.safetensors").items())
    for module in model.modules():
        if isinstance(module, Attention):
            module.kv_cache = torch.zeros(module.cache_shape(blocks, block_size))
            module.block_size, module.backend = block_size, TorchAttentionBackend()
        elif isinstance(module, RecurrentLayer):
            module.bind_states({name: torch.zeros(slots, *s.shape, dtype=s.dtype)
                                for name, s in module.state_shapes().items()})
    return model


def test_padded_decode_step_reads_no_host_value(tiny_v4, monkeypatch):
    """The CUDA path's decode step (Triton, under the interpreter) with metadata as a CUDA graph replays it: no
    host query starts or lengths, two padding rows (no request: slot -1, state slot 0, block table of zeros, stale
    positions), no `.tolist()`/`.item()`/truth value of a tensor anywhere. Three requests prefilled (eagerly) to
    lengths inside the first window, past the top-k and at an HCA window's end, then two such decode steps: the
    real rows' logits equal HF's."""
    import transformers

    from pressroom.attention.backend import AttentionMetadata, forward_context
    from pressroom.attention.state import StateMetadata, StateRound
    from pressroom.kernels import triton as triton_kernels
    from pressroom.model.layers import state
    if torch.cuda.is_available() or not triton_kernels.interpreting():
        pytest.skip("checks the CUDA path's kernels on CPU tensors, under Triton's interpreter")
    from pressroom.kernels.triton.fused_moe import fused_moe
    from pressroom.model.layers.fused_moe import FusedMoE
    monkeypatch.setattr(state, "on_triton", lambda x: True)
    monkeypatch.setattr(FusedMoE, "forward", lambda self, x, weights, ids: fused_moe(  # the experts' CUDA path
        x, self.w13, self.w2, weights, ids, activation=self.activation))
    block_size, per_seq, lengths, state_slots = 8, 8, [3, 30, HCA_RATE * 2 - 1], [2, 3, 1]
    model = _bound_model(tiny_v4, 4, 1 + per_seq * len(lengths), block_size)
    tables = 1 + torch.arange(per_seq * len(lengths)).view(len(lengths), per_seq)
    seqs = [torch.tensor(p) for p in prompts_of([n + 2 for n in lengths], seed=9)]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_v4, dtype=torch.float32)
    with torch.no_grad():
        expected = [hf_model(s.unsqueeze(0)).logits[0] for s in seqs]

    def slot_of(i: int, pos: torch.Tensor) -> torch.Tensor:
        return tables[i, pos // block_size] * block_size + pos % block_size

    qsl = [0] + torch.tensor(lengths).cumsum(0).tolist()
    prefill = AttentionMetadata(
        num_decodes=0, num_decode_tokens=0, block_tables=tables, seq_lens=torch.tensor(lengths),
        slot_mapping=torch.cat([slot_of(i, torch.arange(n)) for i, n in enumerate(lengths)]),
        query_start_loc=qsl, seq_lens_host=lengths, state=StateMetadata.one_round(qsl, state_slots, "cpu"))
    with forward_context(prefill), torch.no_grad():
        model(torch.cat([s[:n] for s, n in zip(seqs, lengths)]), torch.cat([torch.arange(n) for n in lengths]))

    def refuse(*args):
        raise AssertionError("a host value read in a graph-captured decode step")

    rows = len(lengths) + 2
    for step in range(2):
        pos = torch.tensor(lengths) + step
        starts = torch.tensor([0, 1, 2, 3, 3, 3], dtype=torch.int32)
        meta = AttentionMetadata(
            num_decodes=rows, num_decode_tokens=rows, query_start_loc=[], seq_lens_host=[], max_query_len=1,
            block_tables=torch.cat((tables, torch.zeros(2, per_seq, dtype=tables.dtype))),
            seq_lens=torch.cat((pos + 1, torch.zeros(2, dtype=torch.long))),
            slot_mapping=torch.cat((torch.stack([slot_of(i, p) for i, p in enumerate(pos)]), torch.tensor([-1, -1]))),
            query_start_loc_device=starts,
            state=StateMetadata([StateRound(None, list(range(rows + 1)), starts,
                                            torch.tensor(state_slots + [0, 0]), rows)]))
        ids = torch.cat((torch.stack([s[p] for s, p in zip(seqs, pos)]), torch.tensor([7, 7])))
        with forward_context(meta), torch.no_grad(), monkeypatch.context() as m:
            for name in ("tolist", "item", "__bool__"):
                m.setattr(torch.Tensor, name, refuse)
            hidden = model(ids, torch.cat((pos, torch.tensor([40, 3]))))
        got = model.compute_logits(hidden[:len(lengths)])
        want = torch.stack([e[p] for e, p in zip(expected, pos)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
