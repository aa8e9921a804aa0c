"""MTP drafting with a DeepSeek checkpoint's next-token-prediction layer: greedy output equals no speculation,
sampled output keeps the target's distribution, and a checkpoint without the layer is refused clearly."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import random_prompts, record_mtp_drafts, save_with_mtp_layer
from test_spec_engine import _assert_next3_distribution, _gen

from pressroom import LLM, SamplingParams


@torch.inference_mode()
def reference_first_draft(path: Path, tokens: list[int]) -> int:
    """The MTP layer's first draft after `tokens` (prompt and the target's first token), computed with HF's
    modules on the checkpoint: the target's normed hidden states h_j of the prompt, then at each position j
    eh_proj([enorm(embed(x_{j+1})) (zero at position 0); hnorm(h_j)]) through HF's decoder layer L (causal),
    shared_head.norm and the LM head at the last position."""
    import transformers
    from safetensors.torch import load_file
    weights = load_file(path / "model.safetensors")
    config = transformers.AutoConfig.from_pretrained(path)
    layers = config.num_hidden_layers
    config.num_hidden_layers = layers + 1
    full = transformers.AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    prefix = f"model.layers.{layers}."

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * weights[prefix + name]

    prompt = torch.tensor([tokens[:-1]])
    h = full.model.norm(full.model(prompt, output_hidden_states=True).hidden_states[layers])  # [1, m, hidden]
    embedded = full.model.embed_tokens(torch.tensor([tokens[1:]]))
    embedded[:, 0] = 0.0
    x = torch.cat((rms(embedded, "enorm.weight"), rms(h, "hnorm.weight")), dim=-1)
    x = x @ weights[prefix + "eh_proj.weight"].t()
    m = x.shape[1]
    positions = torch.arange(m)[None]
    mask = torch.full((m, m), float("-inf")).triu(1)[None, None]
    out = full.model.layers[layers](x, attention_mask=mask, position_ids=positions,
                                    position_embeddings=full.model.rotary_emb(x, positions))
    out = out[0] if isinstance(out, tuple) else out
    return int(full.lm_head(rms(out[0, -1], "shared_head.norm.weight")).argmax())


MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive_token_budget": False}


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp")
    save_with_mtp_layer(path)
    return str(path)


def test_greedy_output_with_mtp_equals_without(mtp_model):
    prompts = random_prompts(5, low=4, high=60, seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, detokenize=False)
    plain = _gen(LLM(mtp_model, dtype="float32", kv_cache_memory_gib=0.05, skip_tokenizer_init=True), prompts, params)
    llm = LLM(mtp_model, dtype="float32", kv_cache_memory_gib=0.05, skip_tokenizer_init=True,
              speculative_config=MTP)
    assert _gen(llm, prompts, params) == plain
    stats = llm.engine.stats().spec
    assert stats.num_draft_tokens > 0 and stats.num_drafts > 0
    proposer = llm.engine.runner.proposer
    assert type(proposer).__name__ == "MTPProposer"
    # its own latent cache, in the target's block tables: as many blocks, and K slots kept past each step
    mtp_cache, target_cache = proposer.runner.kv_caches[0], llm.engine.runner.kv_caches[0]
    assert mtp_cache.shape[0] == 1 and mtp_cache.shape[1] == target_cache.shape[1]
    assert llm.engine.scheduler.lookahead == 3 and llm.engine.scheduler.async_drafts == 0


@pytest.mark.slow  # two engines over two worker processes each
def test_mtp_over_two_ranks_keeps_greedy_output(mtp_model):
    """Under tensor parallelism the MTP layer's eh_proj output is whole on every rank (its decoder layer's MLA
    splits heads again), so drafting over two ranks keeps the one-rank greedy tokens."""
    prompts = random_prompts(4, low=4, high=40, seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False)
    engine = dict(dtype="float32", kv_cache_memory_gib=0.05, skip_tokenizer_init=True, device="cpu")
    plain = _gen(LLM(mtp_model, **engine), prompts, params)
    llm = LLM(mtp_model, tensor_parallel_size=2, speculative_config=MTP, **engine)
    try:
        assert _gen(llm, prompts, params) == plain
        assert llm.engine.stats().spec.num_draft_tokens > 0
    finally:
        llm.shutdown()


def test_the_first_draft_equals_the_mtp_layer_computed_with_hfs_modules(mtp_model, monkeypatch):
    """What the proposer drafts first after a prompt is the argmax of the MTP layer as HF's own modules compute
    it on the checkpoint: the layer, its weights' rope order, the feature hand-over and positions are right
    (the greedy test above would pass with any drafts at all)."""
    seen = record_mtp_drafts(monkeypatch)
    llm = LLM(mtp_model, dtype="float32", kv_cache_memory_gib=0.05, skip_tokenizer_init=True, speculative_config=MTP)
    for prompt in random_prompts(3, low=5, high=40, seed=4):
        seen.clear()
        _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False))
        tokens, drafts = seen[0]
        assert len(tokens) == len(prompt) + 1
        assert drafts[0] == reference_first_draft(Path(mtp_model), tokens)


def test_mtp_with_a_cached_prefix_and_chunked_prompts_keeps_greedy_output(mtp_model):
    """The target computes only a prompt's uncached tail (its hidden states for the prefix never come), and
    long prompts arrive in chunks: the MTP layer still catches up, and the output stays exact."""
    prefix = random_prompts(1, low=70, high=71, seed=9)[0]
    prompts = [prefix + tail for tail in random_prompts(3, low=3, high=12, seed=10)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False)
    engine = dict(dtype="float32", kv_cache_memory_gib=0.05, skip_tokenizer_init=True, max_num_batched_tokens=32,
                  enable_prefix_caching=True)
    plain = _gen(LLM(mtp_model, **engine), prompts, params)
    llm = LLM(mtp_model, speculative_config=MTP, **engine)
    assert [_gen(llm, [p], params)[0] for p in prompts] == plain  # one by one: the later ones hit the cache


@pytest.mark.slow  # thousands of samples: 6 s
def test_mtp_sampling_keeps_the_target_distribution(tmp_path):
    path = tmp_path / "mtp32"
    path.mkdir()
    hf = save_with_mtp_layer(path, vocab_size=32, init=0.6, seed=5)
    _assert_next3_distribution(str(path), hf, {"method": "mtp", "num_speculative_tokens": 2})


def test_a_checkpoint_without_mtp_layers_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="no next-token-prediction layer"):
        LLM(tiny_model_dir("deepseek_v3"), dtype="float32", kv_cache_memory_gib=0.05, speculative_config=MTP)


def test_mtp_under_the_adaptive_budget_keeps_greedy_output(mtp_model):
    """The default budget profiles the MTP layer's step cost at start-up and plans drafts from it."""
    prompts = random_prompts(3, low=4, high=30, seed=8)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    engine = dict(dtype="float32", kv_cache_memory_gib=0.05, skip_tokenizer_init=True)
    plain = _gen(LLM(mtp_model, **engine), prompts, params)
    llm = LLM(mtp_model, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **engine)
    assert _gen(llm, prompts, params) == plain
    costs = llm.engine.runner.proposer.profile_decode_steps([1, 4])
    assert [n for n, _ in costs] == [1, 4] and all(t > 0 for _, t in costs)


def test_two_mtp_layers_draft_in_turn_and_keep_greedy_output(tmp_path, monkeypatch):
    """A checkpoint with two MTP layers: both load (each its own weights and cache), every layer catches up
    on the target's hidden states, draft j comes from layer j mod 2, and greedy output stays exact."""
    from pressroom.spec_decode.mtp import MTPProposer, MultiTokenPredictor
    save_with_mtp_layer(tmp_path, mtp_layers=2)
    passes, draft_steps = [], []
    forward, draft_step = MultiTokenPredictor.forward, MTPProposer._draft_step

    def recording_forward(self, input_ids, positions):
        passes.append(self.active)
        return forward(self, input_ids, positions)

    def recording_draft_step(self, *args):
        draft_steps.append(self.predictor.active)
        return draft_step(self, *args)

    monkeypatch.setattr(MultiTokenPredictor, "forward", recording_forward)
    monkeypatch.setattr(MTPProposer, "_draft_step", recording_draft_step)
    prompts = random_prompts(3, low=4, high=40, seed=12)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False)
    engine = dict(dtype="float32", kv_cache_memory_gib=0.05, skip_tokenizer_init=True)
    plain = _gen(LLM(str(tmp_path), **engine), prompts, params)
    llm = LLM(str(tmp_path), speculative_config=MTP, **engine)
    passes.clear()  # the start-up's cost profiles
    assert _gen(llm, prompts, params) == plain
    predictor = llm.engine.runner.proposer.predictor
    assert len(predictor.mtp) == 2 and len(llm.engine.runner.proposer.runner.kv_caches) == 2
    assert not torch.equal(predictor.mtp[0].eh_proj.weight, predictor.mtp[1].eh_proj.weight)
    # K = 3: drafts 1 and 2 come from layers 1 and 0; the catch-ups ran both layers (1, then 0)
    assert draft_steps and set(draft_steps) == {0, 1} and draft_steps[:2] == [1, 0]
    assert passes.count(1) > draft_steps.count(1)
