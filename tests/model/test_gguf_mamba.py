"""Mamba and Mamba2 GGUFs written in llama.cpp's layout (convert_hf_to_gguf's names, metadata and transforms: A stored
as -exp(A_log), the conv weight squeezed to [channels, width], Mamba2's A and D as [heads, 1], its norm as
[groups, d_inner / groups] and its dt_bias as ssm_dt.bias) load as HF's config and weights, and generate what HF
generates from the original weights; a Q8_0 file (quantized as the converter's --outtype q8_0 does) follows HF on
its own dequantized weights.

Not compared against llama.cpp itself: llama-cpp-python has no wheel here and building llama.cpp from its sdist
would take far longer than this suite allows.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import hf_prompt_logprobs

from pressroom import LLM, SamplingParams
from pressroom.model import gguf_file
from pressroom.model.gguf_file import iter_gguf_weights, read_gguf_config

transformers = pytest.importorskip("transformers")

VOCAB = 512
T = gguf.GGMLQuantizationType
# HF's leaf names under backbone.layers.N -> llama.cpp's under blk.N (Mamba2's dt_bias: renamed dt_proj.bias first)
_BLOCK = {"norm.weight": "attn_norm.weight", "mixer.in_proj.weight": "ssm_in.weight",
          "mixer.in_proj.bias": "ssm_in.bias", "mixer.out_proj.bias": "ssm_out.bias",
          "mixer.conv1d.weight": "ssm_conv1d.weight", "mixer.conv1d.bias": "ssm_conv1d.bias",
          "mixer.x_proj.weight": "ssm_x.weight", "mixer.dt_proj.weight": "ssm_dt.weight",
          "mixer.dt_proj.bias": "ssm_dt.bias", "mixer.dt_bias": "ssm_dt.bias", "mixer.A_log": "ssm_a",
          "mixer.D": "ssm_d", "mixer.norm.weight": "ssm_norm.weight", "mixer.out_proj.weight": "ssm_out.weight",
          # Nemotron-H's other mixers
          "mixer.q_proj.weight": "attn_q.weight", "mixer.k_proj.weight": "attn_k.weight",
          "mixer.v_proj.weight": "attn_v.weight", "mixer.o_proj.weight": "attn_output.weight",
          "mixer.up_proj.weight": "ffn_up.weight", "mixer.down_proj.weight": "ffn_down.weight",
          "mixer.gate.weight": "ffn_gate_inp.weight", "mixer.gate.e_score_correction_bias": "exp_probs_b.bias",
          "mixer.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
          "mixer.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
          "mixer.fc1_latent_proj.weight": "ffn_latent_down.weight",
          "mixer.fc2_latent_proj.weight": "ffn_latent_up.weight"}
_TOP = {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def _config(version: int, vocab: int):
    """Mamba1 ties its head to the embedding (HF's default), Mamba2 does not; Mamba2 in two groups."""
    if version == 1:
        return transformers.MambaConfig(vocab_size=vocab, hidden_size=64, state_size=8, num_hidden_layers=2,
                                        conv_kernel=4, expand=2, tie_word_embeddings=True)
    return transformers.Mamba2Config(vocab_size=vocab, hidden_size=64, num_heads=8, head_dim=16, state_size=16,
                                     n_groups=2, expand=2, conv_kernel=4, num_hidden_layers=2,
                                     tie_word_embeddings=False)


def _hf_model(version: int, vocab: int = VOCAB) -> torch.nn.Module:
    """A tiny random HF model whose norms, D, conv biases and A all vary, so that each transform shows."""
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(_config(version, vocab), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith((".D", "conv1d.bias")):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(".A_log"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's interleaving of q/k rows on the llama path (Nemotron-H's attention takes it too)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _llama_cpp_tensors(state: dict[str, torch.Tensor], cfg, version: int) -> dict[str, np.ndarray]:
    """convert_hf_to_gguf's MambaModel / Mamba2Model.modify_tensors on an HF checkpoint's tensors (version 2:
    Mamba2's layout, Nemotron-H's too, whose attention rows it permutes as a llama's and whose experts it stacks)."""
    out = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        if name == "lm_head.weight" and torch.equal(t, state["backbone.embeddings.weight"]):
            continue  # a tied head is left out
        if name in _TOP:
            out[_TOP[name]] = t
            continue
        layer, leaf = name.removeprefix("backbone.layers.").split(".", 1)
        if leaf.startswith("mixer.experts."):
            expert, proj = leaf.split(".")[2:4]
            experts.setdefault(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", {})[int(expert)] = t
            continue
        if leaf == "mixer.conv1d.weight":
            t = t.squeeze()
        elif version == 2 and leaf in ("mixer.A_log", "mixer.D"):
            t = t.reshape(*t.shape, 1)
        elif version == 2 and leaf == "mixer.norm.weight":
            t = t.reshape(cfg.n_groups, -1)
        elif leaf in ("mixer.q_proj.weight", "mixer.k_proj.weight"):
            t = _permute(t, cfg.num_attention_heads if leaf[6] == "q" else cfg.num_key_value_heads)
        if leaf == "mixer.A_log":
            t = -torch.exp(t)
        out[f"blk.{layer}.{_BLOCK[leaf]}"] = t
    out |= {name: torch.stack([by_expert[e] for e in sorted(by_expert)]) for name, by_expert in experts.items()}
    return {name: t.float().contiguous().numpy() for name, t in out.items()}


def _stored(name: str, values: np.ndarray, qtype: T) -> tuple[np.ndarray, T]:
    """The converter's type choice: 1-D tensors, norms, the conv and suffix-less A and D stay F32; other matrices
    take qtype, falling back to F16 where a row is not whole Q8_0 blocks."""
    if qtype == T.F32 or values.ndim == 1 or name.endswith(("_norm.weight", "ssm_conv1d.weight")) \
            or not name.endswith(".weight"):
        return values, T.F32
    if values.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return values.astype(np.float16), T.F16
    return gguf.quants.quantize(values, qtype), qtype


def _write_gguf(path: str, model: torch.nn.Module, version: int, qtype: T, tokenizer_from: str | None = None
                ) -> dict[str, T]:
    """The file convert_hf_to_gguf writes (its metadata; a tokenizer's only if given the GGUF to take it from);
    returns each tensor's type."""
    cfg = model.config
    arch = "mamba" if version == 1 else "mamba2"
    writer = gguf.GGUFWriter(path, arch)
    if tokenizer_from is not None:
        _copy_tokenizer(writer, tokenizer_from)
    writer.add_context_length(2**20)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_ssm_conv_kernel(cfg.conv_kernel)
    inner = cfg.expand * cfg.hidden_size
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_state_size(cfg.state_size)
    if version == 1:
        writer.add_ssm_time_step_rank(cfg.time_step_rank)
        writer.add_ssm_dt_b_c_rms(False)
    else:
        writer.add_ssm_time_step_rank(inner // cfg.head_dim)
        writer.add_ssm_group_count(cfg.n_groups)
    writer.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
    types = {}
    for name, values in _llama_cpp_tensors(model.state_dict(), cfg, version).items():
        data, types[name] = _stored(name, values, qtype)
        writer.add_tensor(name, data, raw_dtype=types[name] if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def _copy_tokenizer(writer: gguf.GGUFWriter, source: str) -> None:
    meta = gguf_file._open(source).metadata
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_token_list(list(meta["tokenizer.ggml.tokens"]))
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(list(meta["tokenizer.ggml.merges"]))
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])


def _hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation through HF's cache (recurrent states and KV), one token per forward."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        next_id = out.logits[0, -1].argmax()
        tokens.append(int(next_id))
        out = model(input_ids=next_id.view(1, 1), cache=out.cache, use_cache=True)
    return tokens


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 23, 70)]


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_gib=0.05, max_num_batched_tokens=64,
               **kwargs)


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [next(iter(pos.values())).logprob for pos in o.prompt_logprobs[1:]])
            for o in outs]


def _matches_hf(llm: LLM, model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> None:
    """Greedy tokens equal, prompt logprobs as close as HF's own safetensors load gets (tests/model/test_mamba.py)."""
    with torch.no_grad():
        expected = [(_hf_greedy(model, p, max_tokens), hf_prompt_logprobs(model, p)) for p in prompts]
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(_generate(llm, prompts, max_tokens), expected):
        assert tokens == hf_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, hf_logprobs)) < 1e-4


@pytest.mark.parametrize("version", [1, 2])
def test_f32_gguf_gives_hfs_config_and_weights(version: int, tmp_path):
    model = _hf_model(version)
    path = str(tmp_path / "model.gguf")
    _write_gguf(path, model, version, T.F32)
    config = transformers.AutoConfig.for_model(**read_gguf_config(path))
    keys = ["model_type", "hidden_size", "num_hidden_layers", "state_size", "conv_kernel",
            "expand", "vocab_size", "use_bias", "use_conv_bias", "tie_word_embeddings", "layer_norm_epsilon"]
    keys += ["intermediate_size", "time_step_rank"] if version == 1 else ["num_heads", "head_dim", "n_groups"]
    assert {k: getattr(config, k) for k in keys} == {k: getattr(model.config, k) for k in keys}
    assert config.architectures == [type(model).__name__]
    loaded = {name: weight.load() for name, weight in iter_gguf_weights(path)}
    expected = {k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and version == 1)}
    assert loaded.keys() == expected.keys()
    for name, value in expected.items():
        if name.endswith(".A_log"):  # log(-(-exp(a))): rounded twice
            torch.testing.assert_close(loaded[name], value, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(loaded[name], value), name


@pytest.mark.parametrize("version", [1, 2])
def test_f32_gguf_generates_what_hf_does(version: int, tmp_path):
    """The 70-token prompt over two 64-token steps."""
    model = _hf_model(version)
    path = str(tmp_path / "model.gguf")
    _write_gguf(path, model, version, T.F32)
    _matches_hf(_llm(path), model, _prompts(), 8)


def test_falcon_mamba_is_refused(tmp_path):
    """llama.cpp writes Falcon-Mamba as a mamba with RMSNorms on dt, B and C (ssm.dt_b_c_rms), which HF's
    MambaForCausalLM lacks: refused by name rather than run without them."""
    path = str(tmp_path / "falcon-mamba.gguf")
    writer = gguf.GGUFWriter(path, "mamba")
    for add, value in [(writer.add_block_count, 1), (writer.add_embedding_length, 64), (writer.add_ssm_inner_size, 128),
                       (writer.add_ssm_state_size, 16), (writer.add_ssm_conv_kernel, 4),
                       (writer.add_ssm_time_step_rank, 4), (writer.add_ssm_dt_b_c_rms, True)]:
        add(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="Falcon-Mamba"):
        read_gguf_config(path)


def test_mamba2_gguf_with_a_tokenizer_serves_text(tmp_path, embedded_path, smollm_tokenizer):
    """With the tokenizer in the file (SmolLM2's BPE vocabulary here), a Mamba2 GGUF, an architecture transformers'
    own GGUF loading refuses, runs from text: its tokens as SmolLM2's tokenizer gives them, its greedy
    continuation as HF's."""
    model = _hf_model(2, vocab=len(smollm_tokenizer))
    path = str(tmp_path / "model.gguf")
    _write_gguf(path, model, 2, T.F32, tokenizer_from=embedded_path)
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05)
    text = "The state of a selective scan"
    ids = smollm_tokenizer(text)["input_ids"]
    out = llm.generate([text], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == ids
    with torch.no_grad():
        assert list(out.outputs[0].token_ids) == _hf_greedy(model, ids, 8)
    assert out.outputs[0].text == smollm_tokenizer.decode(out.outputs[0].token_ids)


@pytest.mark.slow  # the F32 files above check every transform; Q8_0 adds llama.cpp's quantization of them
@pytest.mark.parametrize("version", [1, 2])
def test_q8_0_gguf_follows_hf_on_its_dequantized_weights(version: int, tmp_path):
    """Projections and the embedding in Q8_0 (Mamba1's dt_proj, 4-wide rows, in F16): the weights load as their
    dequantized values (near the originals); dense, the model generates what HF does on those values, and kept in
    Q8_0 for the CPU's kernels its prompt logprobs stay within their activation rounding of it."""
    model = _hf_model(version)
    path = str(tmp_path / "model.gguf")
    types = _write_gguf(path, model, version, T.Q8_0)
    assert types["blk.0.ssm_in.weight"] == T.Q8_0 and types["token_embd.weight"] == T.Q8_0
    assert types["blk.0.ssm_a"] == T.F32 and types["blk.0.ssm_conv1d.weight"] == T.F32
    if version == 1:
        assert types["blk.0.ssm_dt.weight"] == T.F16
    dequantized = {name: weight.load() for name, weight in iter_gguf_weights(path)}
    original = model.state_dict()
    for name, value in dequantized.items():
        torch.testing.assert_close(value, original[name], rtol=0.02, atol=0.02)
    model.load_state_dict(dequantized, strict=version == 2)
    prompts = _prompts()
    _matches_hf(_llm(path, quantization="none"), model, prompts, 4)
    kept = _llm(path)
    assert kept.engine.model.backbone.layers[0].mixer.in_proj.ggml is not None
    with torch.no_grad():
        expected = [hf_prompt_logprobs(model, p) for p in prompts]
    gaps = [abs(a - b) for (_, logprobs), hf_logprobs in zip(_generate(kept, prompts, 1), expected)
            for a, b in zip(logprobs, hf_logprobs)]
    assert sum(gaps) / len(gaps) < 0.03 and max(gaps) < 0.2  # measured: 0.01 and 0.06 (AVX-512)
    assert max(gaps) > 1e-6  # the kernels' rounding is really there: the Q8_0 forms ran


# ---------------------------------------------------------------- Qwen3-Next (llama.cpp's qwen3next)

# layer 1 and 3 full attention, GQA in both kinds of layer; every layer MoE (llama.cpp's qwen3next has no dense ones)
QWEN3_NEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  layer_types=["linear_attention", "full_attention"] * 2, initializer_range=0.2,
                  tie_word_embeddings=False)
_QWEN3_NEXT_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                     "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                     "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                     "self_attn.k_norm": "attn_k_norm", "linear_attn.in_proj_ba": "ssm_ba",
                     "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm",
                     "linear_attn.out_proj": "ssm_out", "mlp.gate": "ffn_gate_inp",
                     "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
                     "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _qwen3_next_checkpoint(path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny random HF Qwen3-Next (norm weights random: HF starts the (1 + w) ones at zero) and its checkpoint's
    tensors (per-expert, as convert_hf_to_gguf reads them)."""
    from safetensors.torch import load_file
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3NextConfig(**QWEN3_NEXT),
                                                          dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return model, load_file(f"{path}/model.safetensors")


def _qwen3_next_tensors(hf: dict[str, torch.Tensor], cfg) -> dict[str, np.ndarray]:
    """convert_hf_to_gguf's Qwen3NextModel (over Qwen2MoeModel): norms but the gated one stored as 1 + w, A as
    -exp(A_log), dt_bias as ssm_dt.bias, the conv squeezed, in_proj_qkvz's per-key-head [q, k, v, z] groups split
    into attn_qkv ([q | k | v]) and attn_gate (z), experts stacked."""
    out = {"token_embd.weight": hf.pop("model.embed_tokens.weight"), "output.weight": hf.pop("lm_head.weight"),
           "output_norm.weight": hf.pop("model.norm.weight") + 1}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in hf.items():
        layer, leaf = name.removeprefix("model.layers.").split(".", 1)
        blk, module = f"blk.{layer}.", leaf.rpartition(".")[0]
        if leaf.endswith("norm.weight") and leaf != "linear_attn.norm.weight":
            t = t + 1
        if leaf.startswith("mlp.experts."):
            expert, proj = leaf.split(".")[2:4]
            experts.setdefault((blk, _EXPERTS[proj]), {})[int(expert)] = t
        elif leaf == "linear_attn.in_proj_qkvz.weight":
            dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            vz = cfg.linear_num_value_heads // cfg.linear_num_key_heads * dv
            q, k, v, z = t.reshape(cfg.linear_num_key_heads, -1, t.shape[-1]).split([dk, dk, vz, vz], dim=1)
            out[blk + "attn_qkv.weight"] = torch.cat([p.reshape(-1, t.shape[-1]) for p in (q, k, v)])
            out[blk + "attn_gate.weight"] = z.reshape(-1, t.shape[-1])
        elif leaf == "linear_attn.A_log":
            out[blk + "ssm_a"] = -torch.exp(t)
        elif leaf == "linear_attn.dt_bias":
            out[blk + "ssm_dt.bias"] = t
        elif leaf == "linear_attn.conv1d.weight":
            out[blk + "ssm_conv1d.weight"] = t.squeeze()
        elif leaf == "mlp.shared_expert_gate.weight":
            out[blk + "ffn_gate_inp_shexp.weight"] = t.reshape(-1)
        else:
            out[blk + f"{_QWEN3_NEXT_BLOCK[module]}.weight"] = t
    for (blk, part), by_expert in experts.items():
        out[f"{blk}{part}.weight"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return {name: t.float().contiguous().numpy() for name, t in out.items()}


def _write_qwen3_next_gguf(path: str, hf: dict[str, torch.Tensor], cfg) -> None:
    writer = gguf.GGUFWriter(path, "qwen3next")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    writer.add_full_attention_interval(2)
    writer.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    for name, values in _qwen3_next_tensors(hf, cfg).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_qwen3_next_gguf_generates_what_hf_does(tmp_path):
    """Its config as HF's, in_proj_qkvz joined back from attn_qkv and attn_gate, every other tensor as the
    checkpoint's; then greedy tokens and prompt logprobs as HF's (every layer kind, the full-attention ones over
    a paged KV cache)."""
    model, hf = _qwen3_next_checkpoint(tmp_path / "hf")
    path = str(tmp_path / "model.gguf")
    _write_qwen3_next_gguf(path, dict(hf), model.config)
    config = transformers.AutoConfig.for_model(**read_gguf_config(path))
    for key in [*(k for k in QWEN3_NEXT if k != "initializer_range"), "rope_parameters", "norm_topk_prob",
                "mlp_only_layers", "rms_norm_eps", "decoder_sparse_step"]:
        assert getattr(config, key) == getattr(model.config, key), key
    loaded = {name: weight.load() for name, weight in iter_gguf_weights(path)}
    assert loaded.keys() == hf.keys()
    for name, value in hf.items():
        if name.endswith(".A_log"):
            torch.testing.assert_close(loaded[name], value, rtol=1e-6, atol=1e-6)
        elif name.endswith("norm.weight") and ".linear_attn." not in name:  # (w + 1) - 1
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=1e-7)
        else:
            assert torch.equal(loaded[name], value), name
    _matches_hf(_llm(path), model, _prompts(), 8)


# ---------------------------------------------------------------- Nemotron-H (llama.cpp's nemotron_h)

NEMOTRON_H = dict(vocab_size=VOCAB, hidden_size=64, layers_block_type=["linear_attention", "full_attention", "mlp",
                                                                       "linear_attention"],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, ssm_state_size=16,
                  mamba_num_heads=8, mamba_head_dim=16, n_groups=2, conv_kernel=4, use_bias=True,
                  initializer_range=0.2)


def _write_nemotron_h_gguf(path: str, checkpoint: dict[str, torch.Tensor], cfg) -> None:
    """convert_hf_to_gguf's NemotronHModel (over GraniteHybridModel): the layer pattern as per-layer key/value
    head counts and feed-forward lengths."""
    kinds = cfg.layers_block_type
    moe = "moe" in kinds
    writer = gguf.GGUFWriter(path, "nemotron_h_moe" if moe else "nemotron_h")
    writer.add_block_count(len(kinds))
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    ffn = cfg.moe_intermediate_size if moe else cfg.intermediate_size
    writer.add_feed_forward_length([ffn if k in ("mlp", "moe") else 0 for k in kinds])
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv([cfg.num_key_value_heads if k == "full_attention" else 0 for k in kinds])
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
    writer.add_ssm_conv_kernel(cfg.conv_kernel)
    writer.add_ssm_state_size(cfg.ssm_state_size)
    writer.add_ssm_group_count(cfg.n_groups)
    writer.add_ssm_inner_size(cfg.mamba_num_heads * cfg.mamba_head_dim)
    writer.add_ssm_time_step_rank(cfg.mamba_num_heads)
    if moe:
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(cfg.moe_shared_expert_intermediate_size)
        writer.add_expert_count(cfg.n_routed_experts)
        writer.add_expert_shared_count(cfg.n_shared_experts)
        writer.add_expert_weights_norm(cfg.norm_topk_prob)
        writer.add_expert_weights_scale(cfg.routed_scaling_factor)
        writer.add_expert_group_count(cfg.n_group)
        if cfg.moe_latent_size is not None:
            writer.add_moe_latent_size(cfg.moe_latent_size)
    for name, values in _llama_cpp_tensors(checkpoint, cfg, 2).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# llama.cpp's nemotron_h_moe: experts in place of the MLP (top-2 of 4, a shared expert, routed weights scaled), once
# with the latent projections around the experts
NEMOTRON_H_MOE = dict({k: v for k, v in NEMOTRON_H.items() if k != "intermediate_size"},
                      layers_block_type=["linear_attention", "moe", "full_attention", "moe"], n_routed_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                      n_group=1, topk_group=1, routed_scaling_factor=2.5)


@pytest.mark.parametrize("args", [NEMOTRON_H, NEMOTRON_H_MOE,
                                  pytest.param(dict(NEMOTRON_H_MOE, moe_latent_size=32), marks=pytest.mark.slow)],
                         ids=["dense", "moe", "moe-latent"])
def test_nemotron_h_gguf_generates_what_hf_does(args: dict, tmp_path):
    """Every block kind (Mamba2, attention, ReLU² MLP or experts): the config and weights as HF's, q and k rows
    unpermuted, then greedy tokens and prompt logprobs as HF's."""
    from safetensors.torch import load_file
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(transformers.NemotronHConfig(**args),
                                                          dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith((".D", "conv1d.bias", "in_proj.bias", "out_proj.bias", "e_score_correction_bias")):
                p.copy_(torch.randn(p.shape, generator=g))
    model.save_pretrained(tmp_path / "hf")  # the checkpoint's names (backbone.), as the converter reads them
    checkpoint = load_file(tmp_path / "hf" / "model.safetensors")
    path = str(tmp_path / "model.gguf")
    _write_nemotron_h_gguf(path, checkpoint, model.config)
    config = transformers.AutoConfig.for_model(**read_gguf_config(path))
    for key in [*(k for k in args if k != "initializer_range"), "mlp_bias", "use_conv_bias", "attention_bias",
                "layer_norm_epsilon", "tie_word_embeddings", "mlp_hidden_act", "moe_latent_size", "norm_topk_prob"]:
        assert getattr(config, key) == getattr(model.config, key), key
    loaded = {name: weight.load() for name, weight in iter_gguf_weights(path)}
    assert loaded.keys() == checkpoint.keys()
    for name, value in checkpoint.items():
        if name.endswith(".A_log"):
            torch.testing.assert_close(loaded[name], value, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(loaded[name], value), name
    _matches_hf(_llm(path), model, _prompts(), 8)
