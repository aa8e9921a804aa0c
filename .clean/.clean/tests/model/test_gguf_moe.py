"""GGUF mixtures of experts: llama.cpp's stacked expert tensors ([experts, out, in] per layer) load into
FusedMoE, and the model then generates what HF generates from the same weights in safetensors."""
from __future__ import annotations

import gguf
import pytest
import torch
from conftest import TINY_SHAPE, hf_greedy, random_prompts
from safetensors import safe_open

from pressroom import LLM, SamplingParams

_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
           "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_SHARED = {"gate_proj": "ffn_gate_shexp", "up_proj": "ffn_up_shexp", "down_proj": "ffn_down_shexp"}


def _config(arch: str):
    import transformers
    moe = dict(TINY_SHAPE, num_experts_per_tok=2)
    if arch == "mixtral":
        return transformers.MixtralConfig(**moe, num_local_experts=4, sliding_window=None)
    if arch == "qwen2_moe":  # llama.cpp's qwen2moe has no dense layers
        return transformers.Qwen2MoeConfig(**moe, num_experts=6, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=96, norm_topk_prob=False)
    return transformers.Qwen3MoeConfig(**moe, num_experts=8, moe_intermediate_size=48, head_dim=32,
                                       norm_topk_prob=True)


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's interleaving of q/k rows on the llama path."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _gguf_tensors(hf: dict[str, torch.Tensor], cfg, llama_path: bool) -> dict[str, torch.Tensor]:
    out = {"token_embd.weight": hf.pop("model.embed_tokens.weight"), "output_norm.weight": hf.pop("model.norm.weight"),
           "output.weight": hf.pop("lm_head.weight")}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in hf.items():
        parts = name.split(".")
        layer, blk = int(parts[2]), f"blk.{parts[2]}."
        if parts[3] == "self_attn":
            proj, kind = parts[4], parts[5]
            if proj in ("q_norm", "k_norm"):
                out[blk + f"attn_{proj}.weight"] = t
                continue
            if llama_path and proj in ("q_proj", "k_proj"):
                t = _permute(t, cfg.num_attention_heads if proj == "q_proj" else cfg.num_key_value_heads)
            out[blk + f"{_ATTN[proj]}.{kind}"] = t
        elif parts[3] in ("input_layernorm", "post_attention_layernorm"):
            out[blk + ("attn_norm" if parts[3] == "input_layernorm" else "ffn_norm") + ".weight"] = t
        elif parts[4] == "gate":
            out[blk + "ffn_gate_inp.weight"] = t
        elif parts[4] == "experts":
            experts.setdefault((layer, _EXPERT[parts[6]]), {})[int(parts[5])] = t
        elif parts[4] == "shared_expert":
            out[blk + f"{_SHARED[parts[5]]}.weight"] = t
        elif parts[4] == "shared_expert_gate":
            out[blk + "ffn_gate_inp_shexp.weight"] = t.reshape(-1)
        else:
            raise AssertionError(name)
    for (layer, part), by_expert in experts.items():
        out[f"blk.{layer}.{part}.weight"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def _write_gguf(path: str, hf_dir: str, arch: str, cfg) -> None:
    with safe_open(f"{hf_dir}/model.safetensors", "pt") as f:
        hf = {k: f.get_tensor(k) for k in f.keys()}
    gguf_arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[arch]
    writer = gguf.GGUFWriter(path, gguf_arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None)
                              else cfg.rope_theta)
    writer.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "mixtral":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for name, t in _gguf_tensors(hf, cfg, llama_path=arch == "mixtral").items():
        writer.add_tensor(name, t.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_gguf_moe_generates_what_hf_does_from_the_same_weights(arch, tmp_path):
    import transformers
    cfg = _config(arch)
    torch.manual_seed(1234)
    hf_model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    hf_model.save_pretrained(tmp_path / "hf")
    path = str(tmp_path / "model.gguf")
    _write_gguf(path, str(tmp_path / "hf"), arch, hf_model.config)
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05, skip_tokenizer_init=True)
    prompts = random_prompts(3, seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf_model, p, 24) for p in prompts]
