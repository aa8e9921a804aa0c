"""DeepSeek-V4 under speculative decoding (fp32, tiny random weights): its MTP layer (`mtp.0.*`: e_proj and h_proj
over the target's hyper-connection streams, one sliding-window V4 layer, its own hyper-head) drafts what HF's
modules compute for it, and greedy output with MTP or n-gram drafts equals plain decoding, so drafts the target
rejects leave nothing wrong in the compressors' rings or the compressed caches."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import record_mtp_drafts
from test_deepseek_v4 import CSA_RATE, HCA_RATE, TINY, WINDOW, randomize_

from pressroom import LLM, SamplingParams

MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive_token_budget": False}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive_token_budget": False}
ENGINE = dict(dtype="float32", kv_cache_memory_gib=0.05, skip_tokenizer_init=True, max_num_batched_tokens=48)


def save_tiny_with_mtp(path: Path, seed: int = 0):
    """A tiny V4 checkpoint whose extra layer L ships as DeepSeek's `mtp.0.*` (sliding attention, score-routed
    MoE), with the MTP layer's own enorm, hnorm, e_proj, h_proj, hyper-head and norm. Returns HF's model with
    L + 1 layers (the oracle: its layer L is the MTP block)."""
    import transformers
    from safetensors.torch import load_file, save_file
    layers = TINY["num_hidden_layers"]
    config = transformers.DeepseekV4Config(**TINY | dict(
        num_hidden_layers=layers + 1, layer_types=[*TINY["layer_types"], "sliding_attention"],
        mlp_layer_types=[*TINY["mlp_layer_types"], "moe"]))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    randomize_(model, gen)
    model.save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    block = f"model.layers.{layers}."
    mtp = {"mtp.0." + k.removeprefix(block): v for k, v in weights.items() if k.startswith(block)}
    weights = {k: v for k, v in weights.items() if not k.startswith(block)}
    hidden, hc = TINY["hidden_size"], TINY["hc_mult"]
    mtp |= {"mtp.0.enorm.weight": 1 + 0.2 * torch.randn(hidden, generator=gen),
            "mtp.0.hnorm.weight": 1 + 0.2 * torch.randn(hidden, generator=gen),
            "mtp.0.e_proj.weight": 0.2 * torch.randn(hidden, hidden, generator=gen),
            "mtp.0.h_proj.weight": 0.2 * torch.randn(hidden, hidden, generator=gen),
            "mtp.0.norm.weight": 1 + 0.2 * torch.randn(hidden, generator=gen),
            "mtp.0.hc_head_fn": 0.2 * torch.randn(hc, hc * hidden, generator=gen),
            "mtp.0.hc_head_base": torch.randn(hc, generator=gen),
            "mtp.0.hc_head_scale": 1 + 0.3 * torch.randn(1, generator=gen),
            "mtp.0.emb.tok_emb.weight": weights["model.embed_tokens.weight"].clone(),  # DeepSeek's copies
            "mtp.0.head.weight": weights["head.weight"].clone()}
    save_file(weights | mtp, path / "model.safetensors", metadata={"format": "pt"})
    values = json.loads((path / "config.json").read_text())
    values.update(num_hidden_layers=layers, layer_types=TINY["layer_types"],
                  mlp_layer_types=TINY["mlp_layer_types"], num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(values))
    return model.eval(), {k: v for k, v in mtp.items()}


@pytest.fixture(scope="module")
def tiny_v4_mtp(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek-v4-mtp")
    hf_model, mtp = save_tiny_with_mtp(path)
    return str(path), hf_model, mtp


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def reference_first_draft(hf_model, mtp: dict[str, torch.Tensor], tokens: list[int]) -> int:
    """The MTP layer's first draft after `tokens` (prompt and the target's first token), with HF's modules: HF's
    layer L runs as the MTP block on the streams layer L - 1 leaves over tokens[:-1], turned into its input
    h_proj(hnorm(stream)) + e_proj(enorm(embed(next token))) (zero embedding at position 0) by a pre-hook; its
    output goes through the MTP layer's hyper-head (HF's module with the MTP weights), norm and the LM head."""
    import transformers
    config, eps = hf_model.config, hf_model.config.rms_norm_eps
    layer = hf_model.model.layers[TINY["num_hidden_layers"]]

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * mtp[f"mtp.0.{name}.weight"]

    embedded = hf_model.model.embed_tokens(torch.tensor([tokens[1:]]))
    embedded[:, 0] = 0.0
    e = (rms(embedded, "enorm") @ mtp["mtp.0.e_proj.weight"].t()).unsqueeze(2)
    seen = {}

    def into_mtp(module, args, kwargs):
        streams = args[0] if args else kwargs["hidden_states"]
        mixed = rms(streams, "hnorm") @ mtp["mtp.0.h_proj.weight"].t() + e
        return ((mixed, *args[1:]), kwargs) if args else (args, kwargs | {"hidden_states": mixed})

    hooks = [layer.register_forward_pre_hook(into_mtp, with_kwargs=True),
             layer.register_forward_hook(lambda module, args, out: seen.setdefault("out", out))]
    try:
        hf_model(input_ids=torch.tensor([tokens[:-1]]))
    finally:
        for hook in hooks:
            hook.remove()
    head = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4HyperHead(config)
    head.load_state_dict({"hc_fn": mtp["mtp.0.hc_head_fn"], "hc_base": mtp["mtp.0.hc_head_base"],
                          "hc_scale": mtp["mtp.0.hc_head_scale"]})
    out = seen["out"][0] if isinstance(seen["out"], tuple) else seen["out"]
    return int(hf_model.lm_head(rms(head(out[:, -1:]), "norm"))[0, -1].argmax())


def test_greedy_output_with_mtp_equals_without(tiny_v4_mtp):
    """Prompts past the window and several compressed windows, in chunks; the drafts mostly rejected (random
    weights), so every verify step leaves rejected positions in the rings and compressed caches."""
    path, _, _ = tiny_v4_mtp
    prompts = _prompts(1, [5, 23, 41, 70])
    plain = _generate(LLM(path, **ENGINE), prompts, 40)
    llm = LLM(path, speculative_config=MTP, **ENGINE)
    assert _generate(llm, prompts, 40) == plain
    stats = llm.engine.stats().spec
    assert stats.num_draft_tokens > 0 and stats.num_drafts > 0
    assert type(llm.engine.runner.proposer).__name__ == "MTPProposer"
    # the rings grew by the 3 drafts, to whole windows: CSA 2 x 4 + 3 -> 12 rows, HCA 16 + 3 -> 32
    rings = {m.rate: m.ring for m in llm.engine.runner.model.modules() if type(m).__name__ == "V4Compressor"}
    assert rings == {CSA_RATE: 12, HCA_RATE: 32}


def test_the_first_draft_equals_the_mtp_layer_computed_with_hfs_modules(tiny_v4_mtp, monkeypatch):
    """The first draft after a prompt is the argmax of the MTP layer as HF's modules compute it: the streams
    handed over, e_proj/h_proj, the sliding-window layer, the hyper-head and the names are right."""
    path, hf_model, mtp = tiny_v4_mtp
    seen = record_mtp_drafts(monkeypatch)
    llm = LLM(path, speculative_config=MTP, **ENGINE)
    for prompt in _prompts(4, [6, 2 * WINDOW + 3, 3 * HCA_RATE + 1]):
        seen.clear()
        _generate(llm, [prompt], 4)
        tokens, drafts = seen[0]
        assert len(tokens) == len(prompt) + 1
        assert drafts[0] == reference_first_draft(hf_model, mtp, tokens)


def test_drafts_accepted_in_part_keep_greedy_output(tiny_v4_mtp, monkeypatch):
    """Drafts the target accepts in part (random weights make every real drafter miss): prompt lookup patched
    to draft the plain run's own continuation with one token spoiled, at the first, second or third draft or at
    none, so verify steps close compressed windows at accepted and at rejected positions alike."""
    from pressroom.spec_decode.ngram import NgramProposer
    path, _, _ = tiny_v4_mtp
    prompts = _prompts(7, [9, 30, 45, 64])
    plain = _generate(LLM(path, **ENGINE), prompts, 48)

    def spoiled_truth(self, token_ids: list[int], max_drafts: int) -> list[int]:
        prompt, out = next((p, o) for p, o in zip(prompts, plain) if token_ids[:len(p)] == p)
        done = len(token_ids) - len(prompt)
        drafts = out[done:done + min(self.k, max_drafts)]
        spoil = done % 4  # 3: every draft right
        if spoil < len(drafts):
            drafts[spoil] = (drafts[spoil] + 1) % TINY["vocab_size"]
        return drafts

    monkeypatch.setattr(NgramProposer, "lookup", spoiled_truth)
    llm = LLM(path, speculative_config=NGRAM, **ENGINE)
    assert _generate(llm, prompts, 48) == plain
    stats = llm.engine.stats().spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert all(n > 0 for n in stats.accepted_per_pos)  # every draft position accepted somewhere


def test_a_checkpoint_without_the_mtp_layer_is_refused(tiny_v4_mtp, tmp_path):
    from safetensors.torch import load_file, save_file
    path = Path(tiny_v4_mtp[0])
    for name in ("config.json",):
        (tmp_path / name).write_text((path / name).read_text())
    weights = {k: v for k, v in load_file(path / "model.safetensors").items() if not k.startswith("mtp.0.h_proj")}
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lack 1 tensor\(s\).*h_proj"):
        LLM(str(tmp_path), speculative_config=MTP, **ENGINE)


def test_an_fp8_checkpoints_mtp_layer_loads_dequantized_and_keeps_greedy_output(tiny_v4_mtp, tmp_path):
    """DeepSeek's FP8 block form for the MTP layer too (its e_proj, h_proj, attention and experts): the drafter
    holds the dequantized weights (the twin's, exactly), and greedy output with it equals plain decoding."""
    from safetensors.torch import load_file
    from test_deepseek_v4_fp8 import write_v4_fp8
    fp8, twin = tmp_path / "fp8", tmp_path / "twin"
    write_v4_fp8(Path(tiny_v4_mtp[0]), fp8, twin)
    shipped = load_file(fp8 / "model.safetensors")
    assert shipped["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
    assert shipped["mtp.0.ffn.experts.1.w2.weight"].dtype == torch.float8_e4m3fn
    prompts = _prompts(2, [9, 41])
    plain = _generate(LLM(str(fp8), **ENGINE), prompts, 24)
    llm = LLM(str(fp8), speculative_config=MTP, **ENGINE)
    assert _generate(llm, prompts, 24) == plain
    mtp, dense = llm.engine.runner.proposer.predictor.mtp[0], load_file(twin / "model.safetensors")
    assert torch.equal(mtp.e_proj.weight, dense["mtp.0.e_proj.weight"])
    assert torch.equal(mtp.layer.self_attn.q_b_proj.weight, dense["mtp.0.attn.wq_b.weight"])
    assert torch.equal(mtp.layer.mlp.experts.w2[1], dense["mtp.0.ffn.experts.1.w2.weight"])
