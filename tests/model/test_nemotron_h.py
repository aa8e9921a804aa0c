"""Nemotron-H against HF transformers (fp32, tiny random weights): its Mamba2 mixer (the shared
layers/mamba2_mixer.py) over a packed batch of prefills, chunked prefills and decodes on a state-slot pool, and the
whole model (every block kind) from a save_pretrained checkpoint over the same kind of steps, directly and through
`LLM` (greedy tokens and prompt logprobs)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import hf_greedy, hf_prompt_logprobs, random_prompts

from pressroom import LLM, SamplingParams
from pressroom.attention.backend import AttentionMetadata, forward_context
from pressroom.attention.state import StateMetadata
from pressroom.model.layers.mamba2_mixer import Mamba2Mixer
from pressroom.model.models.nemotron_h import mixer_config

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, NemotronHConfig  # noqa: E402
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer  # noqa: E402

# ---------------------------------------------------------------- a mixer on a slot pool against HF's


@dataclass(frozen=True)
class Piece:
    """One request's tokens in one step: hidden-state rows [start, end) of its sequence, in its state slot."""
    seq: int
    start: int
    end: int
    slot: int


# Three steps over sequences of 11, 13 and 9 tokens, then two more decode steps: a whole prefill and a chunk, a
# decode beside a continued chunk and a fresh prefill, all three decoding. Slot 0 stays unused (padding's).
SCHEDULE = [
    [Piece(0, 0, 11, 1), Piece(1, 0, 5, 3)],
    [Piece(0, 11, 12, 1), Piece(1, 5, 13, 3), Piece(2, 0, 9, 2)],
    [Piece(0, 12, 13, 1), Piece(1, 13, 14, 3), Piece(2, 9, 10, 2)],
    [Piece(2, 10, 11, 2), Piece(0, 13, 14, 1), Piece(1, 14, 15, 3)],
]


def run_schedule(mixer: Mamba2Mixer, seqs: list[torch.Tensor], schedule=SCHEDULE) -> list[torch.Tensor]:
    """Our mixer over `schedule`, each step one packed forward (decodes first); returns each sequence's outputs."""
    mixer.bind_states({name: torch.zeros(4, *s.shape, dtype=s.dtype) for name, s in mixer.state_shapes().items()})
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in schedule:
        step = sorted(step, key=lambda p: p.end - p.start > 1)
        qsl = [0]
        for p in step:
            qsl.append(qsl[-1] + p.end - p.start)
        num_decodes = sum(p.end - p.start == 1 for p in step)
        meta = AttentionMetadata(num_decodes=num_decodes, num_decode_tokens=num_decodes,
                                 slot_mapping=torch.empty(0), block_tables=torch.empty(0), seq_lens=torch.empty(0),
                                 query_start_loc=qsl, seq_lens_host=[],
                                 state=StateMetadata.one_round(qsl, [p.slot for p in step], "cpu", num_decodes))
        with forward_context(meta), torch.no_grad():
            y = mixer(torch.cat([seqs[p.seq][p.start:p.end] for p in step]))
        for p, start, end in zip(step, qsl[:-1], qsl[1:]):
            outs[p.seq].append(y[start:end])
    return [torch.cat(o) for o in outs]


def run_hf(mixer: torch.nn.Module, config, seq: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """HF's mixer over one sequence: its prompt at once, then one token per call through HF's cache."""
    cache = DynamicCache(config=config)
    with torch.no_grad():
        outs = [mixer(seq[None, :prompt_len], cache=cache)[0]]
        assert cache.layers[mixer.layer_idx].recurrent_states[0] is not None, "HF's mixer ignored the cache"
        outs += [mixer(seq[None, t:t + 1], cache=cache)[0] for t in range(prompt_len, seq.shape[0])]
    return torch.cat(outs)


def copy_hf_weights(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            ours.get_parameter(name).copy_(p)


def randomize(module: torch.nn.Module, seed: int = 3) -> None:
    """Every parameter random, the scan's (A_log, dt_bias, D) and the norm weight included."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name != "A_log" else 1.0))


def sequences(hidden: int, lengths=(14, 15, 11), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=g) for n in lengths]


PROMPT_LENS = (11, 13, 9)  # where each sequence's prefill ends in SCHEDULE


def nemotron_config(**overrides) -> NemotronHConfig:
    args = dict(vocab_size=64, hidden_size=16, layers_block_type=["linear_attention"], ssm_state_size=4,
                mamba_num_heads=4, mamba_head_dim=6, n_groups=2, chunk_size=4, conv_kernel=4, use_bias=True)
    return NemotronHConfig(**(args | overrides))


def use_triton_kernels(monkeypatch) -> None:
    """Prefill and decode rows through the Triton kernels (CUDA's; on the CPU Triton's interpreter runs them) with
    the views the mixer hands them."""
    from pressroom.kernels import triton as triton_kernels
    if not triton_kernels.available():
        pytest.skip("neither CUDA nor TRITON_INTERPRET=1: Triton kernels cannot run")
    from pressroom.model.layers import state
    monkeypatch.setattr(state, "on_triton", lambda x: True)


@pytest.mark.parametrize("overrides,kernels", [
    ({}, "torch"), ({}, "triton"), (dict(n_groups=1, chunk_size=128, use_conv_bias=False, use_bias=False), "torch")])
def test_mixer_matches_hf_over_packed_prefill_and_decode_steps(overrides, kernels, monkeypatch):
    if kernels == "triton":
        use_triton_kernels(monkeypatch)
    config = nemotron_config(**overrides)
    theirs = NemotronHMamba2Mixer(config, 0).eval()
    randomize(theirs)
    ours = Mamba2Mixer(mixer_config(config))
    copy_hf_weights(ours, theirs)
    seqs = sequences(16)
    for seq, actual, prompt_len in zip(seqs, run_schedule(ours, seqs), PROMPT_LENS):
        torch.testing.assert_close(actual, run_hf(theirs, config, seq, prompt_len), atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- whole models, caches bound by the test

NUM_SLOTS, BLOCK_SIZE, BLOCKS_PER_SEQ = 4, 16, 8

# Sequences of 33, 47 and 22 tokens: two prefills (one a chunk), then a decode beside a continued chunk and a fresh
# prefill, then two all-decode steps. Requests hold KV blocks [8 seq, 8 seq + 8).
MODEL_SCHEDULE = [
    [Piece(0, 0, 30, 1), Piece(1, 0, 17, 3)],
    [Piece(0, 30, 31, 1), Piece(1, 17, 45, 3), Piece(2, 0, 20, 2)],
    [Piece(0, 31, 32, 1), Piece(1, 45, 46, 3), Piece(2, 20, 21, 2)],
    [Piece(2, 21, 22, 2), Piece(0, 32, 33, 1), Piece(1, 46, 47, 3)],
]
MODEL_SEQ_LENS = (33, 47, 22)


def save_tiny(config, path, seed: int = 1234):
    """A tiny random HF checkpoint as save_pretrained writes it, every 1-d parameter (norm weights, A_log, D,
    dt_bias, conv biases) and the routers' correction bias moved off its init; returns the HF model."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand(buffer.shape) * 0.5)
    model.save_pretrained(path)
    return model.eval()


def load_ours(cls, path, config):
    from safetensors.torch import load_file
    model = cls(config)
    loaded = model.load_weights(load_file(f"{path}/model.safetensors").items())
    assert model.expected_weights() == loaded
    return model.eval()


def bind_caches(model) -> None:
    from pressroom.attention.torch_ref import TorchAttentionBackend
    from pressroom.model.layers.attention import Attention
    from pressroom.model.layers.state import RecurrentLayer
    for module in model.modules():
        if isinstance(module, Attention):
            module.kv_cache = torch.zeros(module.cache_shape(BLOCKS_PER_SEQ * NUM_SLOTS, BLOCK_SIZE))
            module.backend = TorchAttentionBackend()
        elif isinstance(module, RecurrentLayer):
            module.bind_states({name: torch.zeros(NUM_SLOTS, *s.shape, dtype=s.dtype)
                                for name, s in module.state_shapes().items()})


def run_model_schedule(model, seqs: list[torch.Tensor], schedule=MODEL_SCHEDULE) -> list[torch.Tensor]:
    """The whole model over `schedule` (token ids), one packed step each, decodes first; returns each sequence's
    logits."""
    bind_caches(model)
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in schedule:
        step = sorted(step, key=lambda p: p.end - p.start > 1)
        qsl, positions, slot_mapping = [0], [], []
        for p in step:
            qsl.append(qsl[-1] + p.end - p.start)
            pos = torch.arange(p.start, p.end)
            positions.append(pos)
            slot_mapping.append((p.seq * BLOCKS_PER_SEQ + pos // BLOCK_SIZE) * BLOCK_SIZE + pos % BLOCK_SIZE)
        num_decodes = sum(p.end - p.start == 1 for p in step)
        lens = [p.end for p in step]
        tables = torch.stack([torch.arange(BLOCKS_PER_SEQ) + p.seq * BLOCKS_PER_SEQ for p in step])
        meta = AttentionMetadata(num_decodes=num_decodes, num_decode_tokens=num_decodes,
                                 slot_mapping=torch.cat(slot_mapping), block_tables=tables,
                                 seq_lens=torch.tensor(lens), query_start_loc=qsl, seq_lens_host=lens,
                                 state=StateMetadata.one_round(qsl, [p.slot for p in step], "cpu", num_decodes))
        with forward_context(meta), torch.no_grad():
            tokens = torch.cat([seqs[p.seq][p.start:p.end] for p in step])
            logits = model.compute_logits(model(tokens, torch.cat(positions)))
        for p, start, end in zip(step, qsl[:-1], qsl[1:]):
            outs[p.seq].append(logits[start:end])
    return [torch.cat(o) for o in outs]


def check_model_schedule(hf_model, ours, vocab_size: int) -> None:
    """Every token's logits over MODEL_SCHEDULE equal HF's forward over each whole sequence."""
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, vocab_size, (n,), generator=gen) for n in MODEL_SEQ_LENS]
    with torch.no_grad():
        expected = [hf_model(s.unsqueeze(0)).logits[0] for s in seqs]
    for actual, want in zip(run_model_schedule(ours, seqs), expected):
        torch.testing.assert_close(actual, want, atol=1e-4, rtol=1e-4)


LAYERS = ["linear_attention", "full_attention", "moe", "linear_attention", "mlp"]


def nemotron_model_config(**overrides) -> NemotronHConfig:
    """Every block kind; MoE with 6 experts in 2 groups (top-1 group), top-2, a shared expert."""
    args = dict(vocab_size=49152, hidden_size=32, layers_block_type=LAYERS, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=48, ssm_state_size=8, mamba_num_heads=8,
                mamba_head_dim=6, n_groups=2, chunk_size=16, n_routed_experts=6, num_experts_per_tok=2,
                moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1,
                routed_scaling_factor=2.5, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return NemotronHConfig(**(args | overrides))


@pytest.mark.parametrize("overrides", [{}, dict(moe_latent_size=12, vocab_size=256, use_bias=True, mlp_bias=True,
                                                tie_word_embeddings=True)])
def test_whole_model_logits_match_hf_over_packed_steps(overrides, tmp_path):
    """The checkpoint's names (backbone., per-expert matrices) load, and the head stays untied whatever the config
    says, as HF's; logits of chunked prefills and decodes."""
    from pressroom.model.models.nemotron_h import NemotronHForCausalLM
    config = nemotron_model_config(**overrides)
    hf_model = save_tiny(config, tmp_path)
    check_model_schedule(hf_model, load_ours(NemotronHForCausalLM, tmp_path, config), config.vocab_size)


# ---------------------------------------------------------------- through the engine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0)


def engine_prompts(seed: int) -> list[list[int]]:
    """Mixed lengths: three short prompts and one of 150 tokens (three 64-token engine chunks, ten Mamba chunks)."""
    return random_prompts(3, seed=seed) + random_prompts(1, low=150, high=151, seed=seed + 1)


def tiny_llm(path, **engine_args) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=64, **engine_args)


def check_llm(llm: LLM, hf_model, prompts: list[list[int]], max_tokens: int = 64) -> None:
    """`LLM`'s greedy tokens equal HF's (its own cache, a token per forward) and its prompt logprobs HF's."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, max_tokens)
        ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
        assert max(abs(a - b) for a, b in zip(ours, hf_prompt_logprobs(hf_model, prompt))) < 1e-3


PREFIX, CHECKPOINT_EVERY = 100, 32


def check_cached_prefixes(path, hf_model, max_tokens: int) -> None:
    """Prompts sharing a 100-token prefix, the first alone first (with prompt logprobs, which compute every prompt
    token): the rest then start from its state checkpoint and KV blocks at token 96 (checkpoints every 32 tokens),
    to HF's greedy tokens."""
    prefix = random_prompts(1, low=PREFIX, high=PREFIX + 1, seed=5)[0]
    prompts = [prefix + tail for tail in random_prompts(3, low=3, high=30, seed=6)]
    llm = tiny_llm(path, mamba_block_size=CHECKPOINT_EVERY)
    check_llm(llm, hf_model, prompts[:1], max_tokens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert [out.num_cached_tokens for out in outs] == [PREFIX // CHECKPOINT_EVERY * CHECKPOINT_EVERY] * 2
    assert [out.outputs[0].token_ids for out in outs] == [hf_greedy(hf_model, p, max_tokens) for p in prompts[1:]]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, smollm_tokenizer):
    path = tmp_path_factory.mktemp("tiny-nemotron-h")
    hf_model = save_tiny(nemotron_model_config(), path)
    smollm_tokenizer.save_pretrained(path)
    return path, hf_model


# HF's greedy reference runs its torch fallbacks a token per forward (4 x 64 tokens: 4-20 s on 2 busy cores): the
# default suite decodes 16 tokens, the slow one 64
@pytest.mark.parametrize("max_tokens", [16, pytest.param(64, marks=pytest.mark.slow)])
def test_llm_matches_hf_greedy_and_prompt_logprobs(tiny_checkpoint, max_tokens: int):
    path, hf_model = tiny_checkpoint
    check_llm(tiny_llm(path), hf_model, engine_prompts(seed=71), max_tokens)


def test_llm_matches_hf_from_cached_prefixes(tiny_checkpoint):
    check_cached_prefixes(*tiny_checkpoint, max_tokens=8)
