"""DSpark (method "dspark"): a tiny checkpoint written in DeepSpec's layout (config.json with its keys,
safetensors under Qwen3DSparkModel's tensor names, written here by name, not through pressroom's module)
loads and drafts; greedy output equals plain decoding; a Markov head that knows the target's chain gets
its drafts accepted; sampling keeps the target's distribution; the block pass equals DeepSpec's
formulation (context + noise block, one attention over both, built from HF's Qwen3 pieces); and a
checkpoint for another target, too many speculative tokens or no confidence head are refused at start."""
from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch

from pressroom import LLM, SamplingParams


def _deepspec_config(target_dir: str, *, layer_ids=(0,), block_size=4, draft_layers=1, markov_rank=16,
                     markov_head_type="vanilla", confidence=True, with_markov=True, **override) -> dict:
    """config.json as DeepSpec's build_draft_config writes it: the target's config plus the drafter's keys."""
    with open(os.path.join(target_dir, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    cfg.update(architectures=["Qwen3DSparkModel"], model_type="qwen3", num_target_layers=cfg["num_hidden_layers"],
               num_hidden_layers=draft_layers, block_size=block_size, tie_word_embeddings=False,
               layer_types=["full_attention"] * draft_layers, mask_token_id=7, target_layer_ids=list(layer_ids),
               num_anchors=512, enable_confidence_head=confidence, markov_rank=markov_rank,
               head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, attention_bias=False)
    if confidence:
        cfg["confidence_head_with_markov"] = with_markov
    if markov_rank:
        cfg["markov_head_type"] = markov_head_type
    cfg.update(override)
    return cfg


def _deepspec_tensors(cfg: dict, seed: int = 0, std: float = 0.2) -> dict[str, torch.Tensor]:
    """Random weights under Qwen3DSparkModel's state_dict names and shapes."""
    g = torch.Generator().manual_seed(seed)
    d, v, inter, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["head_dim"]
    h, kvh, r = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["markov_rank"]

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1.0 + rnd(n) * 0.5

    t = {"embed_tokens.weight": rnd(v, d), "norm.weight": norm(d), "hidden_norm.weight": norm(d),
         "fc.weight": rnd(d, len(cfg["target_layer_ids"]) * d), "lm_head.weight": rnd(v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        t.update({p + "self_attn.q_proj.weight": rnd(h * hd, d), p + "self_attn.k_proj.weight": rnd(kvh * hd, d),
                  p + "self_attn.v_proj.weight": rnd(kvh * hd, d), p + "self_attn.o_proj.weight": rnd(d, h * hd),
                  p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                  p + "mlp.gate_proj.weight": rnd(inter, d), p + "mlp.up_proj.weight": rnd(inter, d),
                  p + "mlp.down_proj.weight": rnd(d, inter), p + "input_layernorm.weight": norm(d),
                  p + "post_attention_layernorm.weight": norm(d)})
    if r:
        t.update({"markov_head.markov_w1.weight": rnd(v, r), "markov_head.markov_w2.weight": rnd(v, r)})
        if cfg["markov_head_type"] == "gated":
            t.update({"markov_head.gate_proj.weight": rnd(r, d + r), "markov_head.gate_proj.bias": rnd(r)})
        if cfg["markov_head_type"] == "rnn":
            t.update({"markov_head.joint_proj.weight": rnd(3 * r, 2 * r + d),
                      "markov_head.joint_proj.bias": rnd(3 * r)})
    if cfg["enable_confidence_head"]:
        extra = r if cfg.get("confidence_head_with_markov") else 0
        t.update({"confidence_head.proj.weight": rnd(1, d + extra), "confidence_head.proj.bias": rnd(1)})
    return t


def _save(path, cfg: dict, tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: t.contiguous() for k, t in tensors.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


def _checkpoint(target_dir: str, path, seed: int = 0, **cfg_args) -> str:
    cfg = _deepspec_config(target_dir, **cfg_args)
    return _save(path, cfg, _deepspec_tensors(cfg, seed))


def _run(target: str, prompts, params, **engine):
    llm = LLM(target, dtype="float32", kv_cache_memory_gib=0.05, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


def test_dspark_greedy_equals_no_speculation(tiny_model_dir, tmp_path):
    from conftest import random_prompts
    target = tiny_model_dir("llama")
    drafter = _checkpoint(target, tmp_path / "dspark", markov_head_type="gated")
    prompts = random_prompts(3, low=5, high=40, seed=43)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain, _ = _run(target, prompts, params)
    spec, llm = _run(target, prompts, params, speculative_config={
        "method": "dspark", "model": drafter, "num_speculative_tokens": 4, "adaptive_token_budget": False})
    assert spec == plain
    stats = llm.engine.stats().spec
    assert stats.num_drafts > 15 and stats.num_draft_tokens > 3 * stats.num_drafts  # full blocks drafted
    assert stats.stated.total >= stats.num_drafts  # the confidence head's outputs reached the scheduler
    assert llm.engine.kv_cache.usage() == 0.0
    finished = set(llm.engine.runner.proposer.contexts)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert finished and not finished & set(llm.engine.runner.proposer.contexts)  # forgotten at the next step


def test_markov_head_that_knows_the_target_chain_gets_drafts_accepted(tiny_model_dir, tmp_path):
    """A drafter whose backbone says nothing (zero LM head) and whose Markov head holds the target's
    greedy bigrams: its drafts are right exactly where the target's next token follows from the previous
    one, so blocks are accepted several tokens deep only if each slot's bias is taken from the token
    drawn for the slot before (left to right), not from the anchor or the mask."""
    from conftest import random_prompts
    target = tiny_model_dir("llama")
    prompts = random_prompts(3, low=5, high=30, seed=44)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain, _ = _run(target, prompts, params)
    pairs = Counter((a, b) for p, out in zip(prompts, plain) for a, b in zip([p[-1]] + out, out))
    chain: dict[int, int] = {}
    for (a, b), _ in pairs.most_common():
        chain.setdefault(a, b)
    cfg = _deepspec_config(target, markov_rank=len(chain))
    tensors = _deepspec_tensors(cfg, seed=1)
    tensors["lm_head.weight"].zero_()
    w1, w2 = torch.zeros_like(tensors["markov_head.markov_w1.weight"]), torch.zeros_like(
        tensors["markov_head.markov_w2.weight"])
    for j, (a, b) in enumerate(chain.items()):
        w1[a, j], w2[b, j] = 1.0, 10.0
    tensors["markov_head.markov_w1.weight"], tensors["markov_head.markov_w2.weight"] = w1, w2
    drafter = _save(tmp_path / "chain", cfg, tensors)
    spec, llm = _run(target, prompts, params, speculative_config={
        "method": "dspark", "model": drafter, "num_speculative_tokens": 4, "adaptive_token_budget": False})
    assert spec == plain
    stats = llm.engine.stats().spec
    # Most of the output is the chain's: well over one accepted token per draft, and deep blocks.
    assert stats.num_accepted_tokens > 1.5 * stats.num_drafts, stats
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens, stats


@pytest.mark.slow  # 4,000 sampled requests (~20 s on 2 shared cores)
def test_dspark_sampling_keeps_the_target_distribution(tmp_path):
    """The distribution test the other drafters pass: a random DSpark drafter samples 2-token blocks
    through its Markov head at the request's temperature and hands verification the q it drew from."""
    import transformers
    from conftest import TINY_SHAPE
    from test_spec_engine import _assert_next3_distribution
    torch.manual_seed(5)
    config = transformers.LlamaConfig(**dict(TINY_SHAPE, vocab_size=32, initializer_range=0.6))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = str(tmp_path / "vocab32")
    model.save_pretrained(path)
    cfg = _deepspec_config(path, block_size=2, markov_rank=8, mask_token_id=3)
    drafter = _save(tmp_path / "dspark32", cfg, _deepspec_tensors(cfg, seed=9, std=0.6))
    _assert_next3_distribution(path, model, {"method": "dspark", "model": drafter, "num_speculative_tokens": 2})


def _deepspec_block_reference(drafter, cfg: dict, context: torch.Tensor, anchor_embed: torch.Tensor,
                              mask_embed: torch.Tensor) -> torch.Tensor:
    """DeepSpec's backbone for one anchor after C context positions, written as its training forward is:
    noise block [anchor, mask, ...] at positions C..C+B-1, keys/values over cat(context, block) from the
    same k/v projections, one attention with the block seeing all context before the anchor and its own
    block (non-causal), built from HF's Qwen3 norm, MLP and rotary pieces."""
    import transformers
    from transformers.models.qwen3 import modeling_qwen3 as q3
    hf = transformers.Qwen3Config(**{k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                         "head_dim", "intermediate_size", "vocab_size",
                                                         "rms_norm_eps")}, num_hidden_layers=1)
    c, b = context.shape[0], cfg["block_size"]
    rotary = q3.Qwen3RotaryEmbedding(hf)
    noise = torch.cat([anchor_embed[None], mask_embed[None].expand(b - 1, -1)])[None]
    positions = torch.arange(c + b)[None]
    cos, sin = rotary(noise, positions)

    def rms(weight, x):
        n = q3.Qwen3RMSNorm(x.shape[-1], eps=cfg["rms_norm_eps"])
        n.weight.data.copy_(weight)
        return n(x)

    target = rms(drafter.hidden_norm.weight, drafter.fc(context))[None]
    h = noise
    for layer in drafter.layers:
        a = layer.self_attn
        x = rms(layer.input_layernorm.weight, h)
        hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        q = rms(a.q_norm.weight, a.q_proj(x).view(1, b, nh, hd)).transpose(1, 2)
        kv_in = torch.cat([target, x], dim=1)
        k = rms(a.k_norm.weight, a.k_proj(kv_in).view(1, c + b, nkv, hd)).transpose(1, 2)
        v = a.v_proj(kv_in).view(1, c + b, nkv, hd).transpose(1, 2)
        q = q * cos[:, None, -b:] + q3.rotate_half(q) * sin[:, None, -b:]
        k = k * cos[:, None] + q3.rotate_half(k) * sin[:, None]
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        w = torch.softmax(q @ k.transpose(-1, -2) / hd ** 0.5, dim=-1)
        h = h + a.o_proj((w @ v).transpose(1, 2).reshape(1, b, nh * hd))
        h = h + layer.mlp(rms(layer.post_attention_layernorm.weight, h))
    return rms(drafter.norm.weight, h)[0]


def test_block_pass_equals_deepspec_formulation(tiny_model_dir, tmp_path):
    """The cached, incremental context (observed in two pieces) and the block pass give DeepSpec's
    backbone output for the same anchor."""
    from pressroom.spec_decode.dspark import _Context, load_drafter
    target = tiny_model_dir("qwen3")
    cfg = _deepspec_config(target, layer_ids=(0,), draft_layers=2, block_size=5)
    drafter, shared = load_drafter(_save(tmp_path / "d", cfg, _deepspec_tensors(cfg, seed=2)))
    assert shared == set()
    torch.manual_seed(3)
    context = torch.randn(9, cfg["hidden_size"])
    anchor, mask = torch.randn(cfg["hidden_size"]), torch.randn(cfg["hidden_size"])
    with torch.no_grad():
        ctx = _Context()
        ctx.append(drafter.context_kv(context[:6], torch.arange(6)))
        ctx.append(drafter.context_kv(context[6:], torch.arange(6, 9)))
        kv = [(k[None, :ctx.n], v[None, :ctx.n]) for k, v in zip(ctx.k, ctx.v)]
        ours = drafter.block_hidden(anchor[None], mask, torch.tensor([9]), kv, torch.ones(1, 9, dtype=torch.bool))[0]
        ref = _deepspec_block_reference(drafter, cfg, context, anchor, mask)
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


def test_markov_heads_follow_deepspec_step_rules(tiny_model_dir, tmp_path):
    """vanilla: W2 W1[prev]; gated: W2 (sigmoid(G[h; W1[prev]]) * W1[prev]); rnn: a recurrent state carried
    across slots; and the confidence head reads [h; W1[prev]] through a sigmoid."""
    from pressroom.spec_decode.dspark import load_drafter
    target = tiny_model_dir("llama")
    torch.manual_seed(4)
    h, prev = torch.randn(3, 64), torch.tensor([1, 5, 9])
    for kind in ("vanilla", "gated", "rnn"):
        cfg = _deepspec_config(target, markov_head_type=kind, markov_rank=6)
        drafter, _ = load_drafter(_save(tmp_path / kind, cfg, _deepspec_tensors(cfg, seed=5)))
        m = drafter.markov_head
        e = m.markov_w1.weight[prev]
        with torch.no_grad():
            bias, state = m.step(prev, h, m.initial_state(h))
            if kind == "vanilla":
                want = e @ m.markov_w2.weight.T
            elif kind == "gated":
                want = (torch.sigmoid(torch.cat([h, e], -1) @ m.gate_proj.weight.T + m.gate_proj.bias) * e) \
                    @ m.markov_w2.weight.T
            else:
                g, cand, out = (torch.cat([torch.zeros(3, 6), e, h], -1) @ m.joint_proj.weight.T
                                + m.joint_proj.bias).chunk(3, -1)
                want = torch.tanh(out) @ m.markov_w2.weight.T
                assert torch.allclose(state, (1 - torch.sigmoid(g)) * torch.tanh(cand), atol=1e-6)
            assert torch.allclose(bias, want, atol=1e-5)
            p = drafter.confidence_head.proj
            conf = torch.sigmoid(torch.cat([h, e], -1) @ p.weight.T + p.bias)[:, 0]
            assert torch.allclose(drafter.confidence(h, prev), conf, atol=1e-6)


def _refused(target: str, drafter: str, match: str, k: int = 4) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(target, dtype="float32", kv_cache_memory_gib=0.05,
            speculative_config={"method": "dspark", "model": drafter, "num_speculative_tokens": k})


def test_checkpoint_for_another_target_is_refused(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama")
    _refused(target, _checkpoint(target, tmp_path / "width", hidden_size=32, intermediate_size=64), "hidden size 32")
    _refused(target, _checkpoint(target, tmp_path / "ids", layer_ids=(0, 5)), r"target_layer_ids \[0, 5\]")
    _refused(target, _checkpoint(target, tmp_path / "depth", num_target_layers=36), "36 layers")


def test_more_speculative_tokens_than_the_block_is_refused(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama")
    _refused(target, _checkpoint(target, tmp_path / "d", block_size=4), "above the DSpark drafter's block_size 4", k=5)


def test_missing_confidence_head_is_refused(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama")
    _refused(target, _checkpoint(target, tmp_path / "off", confidence=False), "no confidence head")
    cfg = _deepspec_config(target)
    tensors = {k: t for k, t in _deepspec_tensors(cfg).items() if not k.startswith("confidence_head.")}
    _refused(target, _save(tmp_path / "gone", cfg, tensors), "confidence_head.proj")


def test_not_a_dspark_checkpoint_is_refused_by_name(tiny_model_dir, tmp_path):
    from pressroom.config import SpeculativeConfig
    target = tiny_model_dir("llama")
    with pytest.raises(ValueError, match='"dspark" needs "model"'):
        SpeculativeConfig(method="dspark")
    cfg = _deepspec_config(target)
    del cfg["target_layer_ids"]
    _refused(target, _save(tmp_path / "nokey", cfg, _deepspec_tensors(_deepspec_config(target))), "target_layer_ids")
    cfg = _deepspec_config(target)
    tensors = _deepspec_tensors(cfg)
    tensors["layers.0.self_attn.qkv_proj.weight"] = tensors.pop("layers.0.self_attn.q_proj.weight")
    _refused(target, _save(tmp_path / "names", cfg, tensors), "missing layers.0.self_attn.q_proj.weight")


def test_checkpoint_without_embedding_and_head_uses_the_targets(tiny_model_dir, tmp_path):
    """DeepSpec copies the target's embedding and LM head into the drafter; a checkpoint that leaves them
    out drafts with the target's own."""
    target = tiny_model_dir("llama")
    cfg = _deepspec_config(target)
    tensors = {k: t for k, t in _deepspec_tensors(cfg).items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    drafter = _save(tmp_path / "bare", cfg, tensors)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain, _ = _run(target, [[5, 6, 7, 8, 9]], params)
    spec, llm = _run(target, [[5, 6, 7, 8, 9]], params, speculative_config={
        "method": "dspark", "model": drafter, "num_speculative_tokens": 3, "adaptive_token_budget": False})
    assert spec == plain  # batch 1: the drafter reads its context buffers unpadded
    proposer = llm.engine.runner.proposer
    assert proposer.embed is llm.engine.runner.model.model.embed_tokens
    assert proposer.head == llm.engine.runner.model.compute_logits
    assert llm.engine.stats().spec.num_draft_tokens > 0
