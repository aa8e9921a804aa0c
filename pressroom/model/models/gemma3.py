"""Gemma 3's text model: local (sliding-window) and global attention layers, each kind with its own rope
base; q/k norms; four norms a layer (before and after attention and the MLP); GELU-tanh gated MLP; the
embedding scaled by sqrt(hidden); a tied LM head with optional final logit softcapping.

Gemma's norms scale by (1 + w). The parameter holds 1 + w (added when a checkpoint's w is loaded), so the
plain RMSNorm kernels run them unchanged.

Gemma 3 with images (`Gemma3ForConditionalGeneration`): a SigLIP tower (siglip.py) whose patches are average-pooled
to `mm_tokens_per_image` rows, RMS-normed and projected into the text model, where they replace the prompt's image
tokens (after the embedding's scaling). A prompt's image tokens attend bidirectionally among their run of image
tokens (HF's rule: a query in a run of image tokens also sees the run's later tokens, in global and local layers
alike; text tokens stay causal). A prefill chunk therefore holds a run's remaining tokens whole: the item is marked
`bidirectional`, which the scheduler honours, and the step's `see_ahead` tells the attention backend how far past
itself each token looks (the torch backends mask it; on CUDA the Triton backend recomputes such chunks with the torch
reference, its kernel being causal only).
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.attention.backend import AttentionMetadata, get_attention_metadata
from pressroom.attention.torch_ref import write_kv
from pressroom.kernels import cpu
from pressroom.model.layers import cpu_decode
from pressroom.model.layers.activation import GeluTanhAndMul
from pressroom.model.layers.attention import Attention
from pressroom.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pressroom.model.layers.norm import RMSNorm
from pressroom.model.layers.rotary import RotaryEmbedding
from pressroom.model.lazy_weight import materialize
from pressroom.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RopeTables
from pressroom.model.models.media_lm import VISION_RENAMES, VISION_TOWER, TowerNameMap
from pressroom.model.models.qwen2_5_vl import lift_text_config
from pressroom.model.models.siglip import SiglipVisionModel
from pressroom.multimodal.inputs import MediaItem, MediaRows

SLIDING = "sliding_attention"
SMALL_STEP = 128  # tokens: a prompt chunk up to this size keeps torch's own ops on one thread


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight w means a scale of 1 + w."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"norm weight has shape {tuple(loaded.shape)}; the model expects {tuple(param.shape)}.")
        param.data.copy_(materialize(loaded).float() + 1.0)  # in fp32, as HF adds it


def _layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:  # older configs: a period, every `pattern`-th layer global
        pattern = getattr(config, "sliding_window_pattern", 6)
        types = [SLIDING if (i + 1) % pattern else "full_attention" for i in range(config.num_hidden_layers)]
    return list(types)


def _rope(config, layer_type: str) -> tuple[float, dict | None]:
    """(base, scaling or None) of a layer type, from transformers 5's per-type rope_parameters or the older
    rope_theta / rope_local_base_freq / rope_scaling."""
    params = (getattr(config, "rope_parameters", None) or {}).get(layer_type)
    if params is None:
        local = layer_type == SLIDING
        base = getattr(config, "rope_local_base_freq", 10000.0) if local else getattr(config, "rope_theta", 1e6)
        return base, None if local else getattr(config, "rope_scaling", None)
    scaling = params if params.get("rope_type", "default") != "default" else None
    return params["rope_theta"], scaling


def _rotary(config, layer_type: str) -> RotaryEmbedding:
    base, scaling = _rope(config, layer_type)
    rotary = RotaryEmbedding(config.head_dim, config.head_dim, config.max_position_embeddings, base, scaling)
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    # llama.cpp's tables (Gemma3Model.ggml_numerics): its frequency scale, where the scaling is one it has
    rotary.ggml_rope = (base, 1.0 if kind is None else 1.0 / scaling["factor"] if kind == "linear" else None)
    return rotary


class Gemma3Attention(LlamaAttention):
    def __init__(self, config, layer_type: str) -> None:
        super().__init__(config, qk_norm=True)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        window = config.sliding_window if layer_type == SLIDING else None
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, config.query_pre_attn_scalar ** -0.5,
                              sliding_window=window)

    def forward_ggml(self, rope: RopeTables, x: torch.Tensor, rows: GgmlStepRows) -> torch.Tensor:
        """llama.cpp's arithmetic (Gemma3Model.ggml_numerics): its norms, an fp16-rounded cache, its attention."""
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        heads = self.qkv_proj(x).view(-1, h + 2 * kv, d)
        q = cpu.ggml_rms_norm(heads[:, :h].contiguous(), self.q_norm.weight, self.q_norm.eps, None)
        k = cpu.ggml_rms_norm(heads[:, h:h + kv].contiguous(), self.k_norm.weight, self.k_norm.eps, None)
        qk = cpu.ggml_rotary_(torch.cat((q, k), dim=1), rope.cos, rope.sin)
        k16, v16 = qk[:, h:].half().float(), heads[:, h + kv:].half().float()  # llama.cpp's fp16 KV cache
        meta = get_attention_metadata()
        write_kv(self.attn.kv_cache, k16, v16, meta.slot_mapping)
        out = cpu.ggml_attention(qk[:, :h].contiguous(), self.attn.kv_cache[0], self.attn.kv_cache[1], rows.tables,
                                 rows.lens, rows.gemm, self.attn.sliding_window, self.attn.scale)
        return self.o_proj(out.flatten(1))


@dataclass(frozen=True, slots=True)
class GgmlStepRows:
    """Per query token of a step, what llama.cpp's arithmetic needs (Gemma3Model.ggml_numerics): its request's block
    table, its context length (itself included), whether it came in a chunk of two or more tokens (llama.cpp's
    batched attention order) and whether llama.cpp's 4-row Q4_K gemm would take it (the first n - n % 4 of a chunk of
    n). Made once a forward from the step's metadata, and handed to each layer."""
    tables: torch.Tensor
    lens: torch.Tensor
    gemm: torch.Tensor
    rows4: torch.Tensor

    @classmethod
    def of(cls, meta: AttentionMetadata) -> GgmlStepRows:
        reqs, lens, gemm, rows4 = [], [], [], []
        loc = meta.query_start_loc
        for i in range(len(loc) - 1):
            n = loc[i + 1] - loc[i]
            reqs += [i] * n
            lens += range(meta.seq_lens_host[i] - n + 1, meta.seq_lens_host[i] + 1)
            gemm += [int(n > 1)] * n
            rows4 += [1] * (n - n % 4) + [0] * (n % 4)
        return cls(meta.block_tables[torch.tensor(reqs)].contiguous(), torch.tensor(lens, dtype=torch.int64),
                   torch.tensor(gemm, dtype=torch.int64), torch.tensor(rows4, dtype=torch.int64))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_type: str) -> None:
        super().__init__()
        self.local = layer_type == SLIDING
        self.self_attn = Gemma3Attention(config, layer_type)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, GeluTanhAndMul())
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, rope: RopeTables, x: torch.Tensor, residual: torch.Tensor | None,
                ggml: GgmlStepRows | None = None, see_ahead: torch.Tensor | None = None):
        """The layer's input is x + residual (x alone for the first); returns its output in the same split, so
        each residual add is fused into the next norm. ggml: the step's rows for llama.cpp's arithmetic
        (Gemma3Model.ggml_numerics), None for torch's; see_ahead: the step's image tokens' bidirectional reach
        (`image_see_ahead`), None: causal."""
        if ggml is not None:
            return self._forward_ggml(rope, x, residual, ggml)
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(rope, x, see_ahead))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual

    def _forward_ggml(self, rope: RopeTables, x: torch.Tensor, residual: torch.Tensor | None, rows: GgmlStepRows):
        def norm(module, x, residual=None):
            return cpu.ggml_rms_norm(x.contiguous(), module.weight, module.eps, residual)
        if residual is None:
            x, residual = norm(self.input_layernorm, x), x.contiguous()
        else:
            x = norm(self.input_layernorm, x, residual)  # residual += x, in place
        x = norm(self.post_attention_layernorm, self.self_attn.forward_ggml(rope, x, rows))
        x = norm(self.pre_feedforward_layernorm, x, residual)
        x = self.mlp.down_proj(cpu.ggml_geglu(self.mlp.gate_up_proj(x).contiguous()))
        return norm(self.post_feedforward_layernorm, x), residual


class Gemma3Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size ** 0.5
        types = _layer_types(config)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, t) for t in types)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_global = _rotary(config, "full_attention")
        self.rotary_local = _rotary(config, SLIDING)
        # CPU decode steps in one C call (layers/cpu_decode.py); built at the first step that can use it.
        self.fused_decode: bool | None = None  # None: not yet asked whether the layers support it
        self._decode_stack: cpu_decode.Gemma3DecodeStack | None = None
        # llama.cpp's CPU arithmetic around the products (kernels/csrc/ggml_numerics.c), on where every projection
        # kept its GGML form (a GGUF as shipped) and the model and cache are fp32; PRESSROOM_GGML_NUMERICS=0: off.
        self.ggml_numerics: bool | None = None  # None: not yet asked

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple[int, ...] = (),
                media: MediaRows | None = None) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # HF rounds the scale to the weights' dtype first
        if media is not None:
            return self._forward_media(x, positions, media, aux_layers)
        ggml = self._ggml_numerics(x)  # first: it may swap the rope tables
        local = RopeTables(self.rotary_local, *self.rotary_local.cos_sin(positions))
        glob = RopeTables(self.rotary_global, *self.rotary_global.cos_sin(positions))
        stack = None if aux_layers else cpu_decode.current_stack(self, cpu_decode.Gemma3DecodeStack, input_ids)
        if stack is not None:  # the C stack taps no layer; its fp32 states go to the LM head unrounded
            return stack.run(x, (local.cos, local.sin, glob.cos, glob.sin), get_attention_metadata(), ggml)
        rows = GgmlStepRows.of(get_attention_metadata()) if ggml else None
        with (cpu.TorchOpsAlone() if self._small_ggml_step(input_ids) else nullcontext(),
              cpu.ggml_q4_k_gemm_rows(rows.rows4) if ggml else nullcontext()):
            residual, taps = None, {}
            for i, layer in enumerate(self.layers):
                x, residual = layer(local if layer.local else glob, x, residual, rows)
                if i in aux_layers:
                    taps[i] = x + residual
            if ggml:
                x = cpu.ggml_rms_norm(x.contiguous(), self.norm.weight, self.norm.eps, residual)
            else:
                x, _ = self.norm(x, residual)
        return (x, [taps[i] for i in aux_layers]) if aux_layers else x

    def _forward_media(self, x: torch.Tensor, positions: torch.Tensor, media: MediaRows, aux_layers: tuple[int, ...]):
        """A step with image rows (which replace their tokens' scaled embeddings): torch's layers, eagerly, with
        each image token seeing the rest of its image."""
        x = x.index_copy(0, media.index, media.rows.to(x.dtype))
        see_ahead = image_see_ahead(media.index, get_attention_metadata().query_start_loc, x.shape[0])
        local = RopeTables(self.rotary_local, *self.rotary_local.cos_sin(positions))
        glob = RopeTables(self.rotary_global, *self.rotary_global.cos_sin(positions))
        residual, taps = None, {}
        for i, layer in enumerate(self.layers):
            x, residual = layer(local if layer.local else glob, x, residual, see_ahead=see_ahead)
            if i in aux_layers:
                taps[i] = x + residual
        x, _ = self.norm(x, residual)
        return (x, [taps[i] for i in aux_layers]) if aux_layers else x

    def _ggml_numerics(self, x: torch.Tensor) -> bool:
        if self.ggml_numerics is None:
            caches = [layer.self_attn.attn.kv_cache for layer in self.layers]
            if any(c is None for c in caches):  # a step before the caches are bound (profiling): ask again later
                return False
            self.ggml_numerics = (os.environ.get("PRESSROOM_GGML_NUMERICS", "1") != "0" and x.device.type == "cpu"
                                  and x.dtype == torch.float32 and self.norm.weight.dtype == torch.float32
                                  and all(c.dtype == torch.float32 and c.is_contiguous() for c in caches)
                                  and cpu_decode.Gemma3DecodeStack.supports(self))
            for rotary in (self.rotary_local, self.rotary_global) if self.ggml_numerics else ():
                base, freq_scale = rotary.ggml_rope
                if freq_scale is not None:
                    rotary.cos, rotary.sin = cpu.ggml_rope_tables(rotary.cos.shape[0], rotary.cos.shape[1], base,
                                                                  freq_scale)
        return self.ggml_numerics

    def _small_ggml_step(self, input_ids: torch.Tensor) -> bool:
        """A step of at most SMALL_STEP tokens through GGML forms on the CPU: its products are the C kernels', and
        torch's other ops are better on one thread (kernels/cpu.TorchOpsAlone)."""
        if input_ids.device.type != "cpu" or input_ids.shape[0] > SMALL_STEP:
            return False
        if self.fused_decode is None:
            self.fused_decode = cpu_decode.Gemma3DecodeStack.supports(self)
        return bool(self.fused_decode)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Loads as the Llama family does (stacked qkv and gate_up, tied head); only the modules differ."""

    applies_sliding_window = True  # its local layers mask by window: contexts may run past it

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("attention logit softcapping (attn_logit_softcapping) is not supported; Gemma 3 "
                             "checkpoints do not use it.")
        self.config = config
        self.model = Gemma3Model(config)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap


def image_see_ahead(index: torch.Tensor, query_start_loc: list[int], num_tokens: int) -> torch.Tensor:
    """[num_tokens] int64: how many keys past itself each of the step's tokens sees. Image rows at flat `index`
    form runs (consecutive tokens of one request, adjacent images merging as HF's token_type_ids runs do); each
    sees up to its run's last token in the step, every other token 0 (causal). The scheduler never ends a chunk
    inside a run, so a run's last token in the step is its last."""
    idx = index.to("cpu", torch.int64).sort().values
    out = torch.zeros(num_tokens, dtype=torch.int64)
    if idx.numel():
        request = torch.bucketize(idx, torch.tensor(query_start_loc[1:-1], dtype=torch.int64), right=True)
        starts = torch.ones_like(idx, dtype=torch.bool)
        starts[1:] = (idx[1:] != idx[:-1] + 1) | (request[1:] != request[:-1])
        run = starts.cumsum(0) - 1
        last = torch.zeros(int(run[-1]) + 1, dtype=torch.int64).scatter_reduce(0, run, idx, "amax")
        out[idx] = last[run] - idx
    return out.to(index.device)


class Gemma3Projector(nn.Module):
    """HF's Gemma3MultiModalProjector: the tower's patch grid average-pooled to `mm_tokens_per_image` rows, RMS-normed
    (Gemma's 1 + w, in fp32) and multiplied into the text model's width."""

    def __init__(self, config) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(config.mm_tokens_per_image ** 0.5)
        if tokens_per_side ** 2 != config.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image ({config.mm_tokens_per_image}) must be a square whose side divides "
                             f"the tower's {self.patches_per_side} patches a side.")
        self.kernel = self.patches_per_side // tokens_per_side
        self.eps = vision.layer_norm_eps
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision.hidden_size, text.hidden_size))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.zeros(vision.hidden_size))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision hidden] -> [images, tokens, text hidden]."""
        n, _, dim = patches.shape
        grid = patches.transpose(1, 2).reshape(n, dim, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.mm_soft_emb_norm.weight.float())
        return torch.matmul(x.to(patches.dtype), self.mm_input_projection_weight)


class Gemma3ForConditionalGeneration(TowerNameMap, Gemma3ForCausalLM):
    """Gemma 3 with its SigLIP tower. Steps without image rows are the text model's (CUDA graphs, the CPU's fused
    decode); steps with them run eagerly (Gemma3Model._forward_media)."""

    supports_multimodal = True
    uses_mrope = False
    TOWER, RENAMES = VISION_TOWER, VISION_RENAMES

    def __init__(self, config) -> None:
        vision = config.vision_config
        if getattr(vision, "model_type", "") != "siglip_vision_model":
            raise ValueError(f"Gemma 3 with a {getattr(vision, 'model_type', '?')} tower is not supported (SigLIP's "
                             "is).")
        lift_text_config(config, None)
        config.text_config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))  # the top's says
        super().__init__(config.text_config)
        self.image_token_id = int(config.image_token_id)
        self.vision_tower = SiglipVisionModel(vision)
        self.multi_modal_projector = Gemma3Projector(config)

    def encode_media(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Each image's rows ([mm_tokens_per_image, hidden]), every image in one batch through the tower."""
        device = self.lm_head.weight.device
        dtype = self.vision_tower.embeddings.patch_embedding.weight.dtype
        pixels = torch.cat([m.pixel_tensor() for m in items]).to(device=device, dtype=dtype)
        if pixels.shape[0] != len(items):  # the processor's pan-and-scan crops: images of their own in HF's prompt
            raise ValueError("Gemma 3's pan-and-scan crops are not supported; set do_pan_and_scan to false in the "
                             "model's preprocessor_config.json.")
        return list(self.multi_modal_projector(self.vision_tower(pixels)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple[int, ...] = (),
                media: MediaRows | None = None):
        if media is not None and self.image_token_id >= self.model.embed_tokens.weight.shape[0]:
            input_ids = input_ids.masked_fill(input_ids == self.image_token_id, 0)  # HF's, for one past the vocab
        return self.model(input_ids, positions, aux_layers, media)

    def skips(self, name: str) -> bool:
        # SigLIP's pooling head (vision_use_head) is not read: Gemma 3 takes the tower's last hidden state
        return name.endswith("position_ids") or name.startswith("vision_tower.head.") or super().skips(name)

