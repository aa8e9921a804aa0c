"""DSpark (DeepSeek's DeepSpec drafter): a block of draft tokens per pass from fused target features.

The drafter is a small stack of Qwen3-style decoder layers. Its context is not a token sequence but
the residual stream of a few target layers (`target_layer_ids`) at every verified position, fused to
the drafter's width (`fc`, then `hidden_norm`); each layer projects that context through its own
k/v projections, so the context costs one projection per layer and position, cached per request.
The block: the anchor (the newest verified token, at position n when n context positions precede
it) followed by `block_size - 1` mask tokens, at positions n .. n + block_size - 1. Every block
position attends to the whole context and to every other block position (no causal mask), and
slot i's hidden state predicts the token at position n + i + 1.

Two heads refine the block:
- the Markov head, a low-rank bias on slot i's logits from the token before it (the anchor for slot
  0, then the drafted token of slot i - 1), applied left to right as tokens are drawn:
  vanilla `W2 W1[prev]`, gated `W2 (sigmoid(G [h; W1[prev]]) * W1[prev])`, or a small recurrent
  state (rnn);
- the confidence head, a logistic estimate per slot that its token survives verification given the
  ones before it (trained on the per-position acceptance rate): the drafts' `confidences`, which the
  adaptive budget (core/spec_budget.py) calibrates and plans with, as it does DFlash2's.

Checkpoints are DeepSpec's own layout: Hugging Face `config.json` (the target's config plus
`block_size`, `target_layer_ids`, `num_target_layers`, `mask_token_id`, `markov_rank`,
`markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`) and safetensors under
the module names of `Qwen3DSparkModel` (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`,
`markov_head.markov_w1.weight`, `confidence_head.proj.weight`, ...). `embed_tokens` and `lm_head`
are copies of the target's; where a checkpoint leaves them out, the target's own are used.

Targets: any whose forward hands over aux layers (Llama-like families, DeepSeek-V2/V3/V3.2 with MLA). A DeepSeek-V4
target hands over each layer's hyper-connection streams; its `collapse_streams` averages them into one hidden state
per layer (as vLLM feeds DeepSeek's own V4 DSpark), and its last layer may be read (taken before the hyper head).
The drafter's rope is its config's (YaRN included: a config copied from DeepSeek-V3's keeps the target's YaRN).
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.config import SpeculativeConfig
from pressroom.model.layers.rotary import _inv_freq
from pressroom.worker.device import synchronize
from pressroom.worker.model_runner import ModelRunner
from pressroom.worker.proposer import Draft, DraftRequest, Proposer

CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
ARCHITECTURES = ("Qwen3DSparkModel",)
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
ROPE_TYPES = ("default", "yarn", "llama3")  # those whose scaling is in the frequencies alone
# Keys DeepSpec's build_draft_config writes beside the target's own; without them it is no DSpark drafter.
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                 "block_size", "target_layer_ids", "mask_token_id", "markov_rank", "enable_confidence_head")
SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True, slots=True)
class DSparkConfig:
    hidden_size: int
    num_hidden_layers: int  # the drafter's own layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    hidden_act: str
    block_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None  # the target's depth the drafter was trained for (None: not recorded)
    mask_token_id: int
    markov_rank: int
    markov_head_type: str | None
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    # The rope's scaling as HF's rope_parameters give it (None: plain): a config copied from a DeepSeek-V3
    # target carries its YaRN, and DeepSpec's drafter rotates with the config's rope.
    rope_scaling: dict | None = None

    @classmethod
    def from_hf(cls, meta: dict, path: str) -> DSparkConfig:
        """The drafter's config.json as DeepSpec writes it; what it lacks or cannot mean is refused by name."""
        missing = [k for k in REQUIRED_KEYS if meta.get(k) is None]  # a target's config may hold them as null
        if missing:
            raise ValueError(f"{path!r} is not a DSpark checkpoint: its {CONFIG_FILE} lacks {', '.join(missing)}.")
        arch = (meta.get("architectures") or ["Qwen3DSparkModel"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"DSpark drafter {path!r} is a {arch}; pressroom loads {', '.join(ARCHITECTURES)}.")
        rope = meta.get("rope_scaling") or meta.get("rope_parameters") or {}
        if rope and all(isinstance(v, dict) for v in rope.values()):
            raise ValueError(f"DSpark drafter {path!r}: its rope_parameters hold one set per attention kind "
                             f"({', '.join(rope)}), as the target's config (DeepSeek-V4's) does; the drafter's layers "
                             "read one: set rope_parameters in its config.json to the single dict it was trained with.")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"DSpark drafter {path!r} uses rope type {rope_type!r}; pressroom's DSpark reads "
                             f"{', '.join(ROPE_TYPES)}.")
        markov_rank = int(meta["markov_rank"])
        head_type = meta.get("markov_head_type") if markov_rank > 0 else None
        if markov_rank > 0 and str(head_type).lower() not in MARKOV_HEAD_TYPES:
            raise ValueError(f"DSpark drafter {path!r}: markov_head_type must be one of "
                             f"{', '.join(MARKOV_HEAD_TYPES)} when markov_rank > 0, got {head_type!r}.")
        heads = int(meta["num_attention_heads"])
        cfg = cls(
            hidden_size=int(meta["hidden_size"]), num_hidden_layers=int(meta["num_hidden_layers"]),
            num_attention_heads=heads, num_key_value_heads=int(meta.get("num_key_value_heads", heads)),
            head_dim=int(meta.get("head_dim") or meta["hidden_size"] // heads),
            intermediate_size=int(meta["intermediate_size"]), vocab_size=int(meta["vocab_size"]),
            rms_norm_eps=float(meta.get("rms_norm_eps", 1e-6)),
            rope_theta=float(meta.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            attention_bias=bool(meta.get("attention_bias", False)), hidden_act=meta.get("hidden_act", "silu"),
            block_size=int(meta["block_size"]), target_layer_ids=tuple(int(i) for i in meta["target_layer_ids"]),
            num_target_layers=int(meta["num_target_layers"]) if "num_target_layers" in meta else None,
            mask_token_id=int(meta["mask_token_id"]), markov_rank=markov_rank,
            markov_head_type=None if head_type is None else str(head_type).lower(),
            enable_confidence_head=bool(meta["enable_confidence_head"]),
            confidence_head_with_markov=bool(meta.get("confidence_head_with_markov", False)),
            rope_scaling=None if rope_type == "default" else dict(rope))
        if cfg.block_size < 1 or not cfg.target_layer_ids:
            raise ValueError(f"DSpark drafter {path!r}: block_size must be >= 1 and target_layer_ids non-empty.")
        if cfg.confidence_head_with_markov and cfg.markov_rank == 0:
            raise ValueError(f"DSpark drafter {path!r}: confidence_head_with_markov needs a Markov head.")
        return cfg


class RMSNorm(nn.Module):
    """Qwen3's: normalised in fp32, cast back, then scaled."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rope:
    """The drafter's RoPE tables, made on first use on the positions' device (the drafter is built on meta)."""

    def __init__(self, cfg: DSparkConfig) -> None:
        self.cfg = cfg
        self.inv_freq: torch.Tensor | None = None
        self.magnitude = 1.0  # YaRN's attention factor, on cos and sin

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., head_dim] for integer positions of any shape (the halves repeated, as rotate_half wants)."""
        if self.inv_freq is None or self.inv_freq.device != positions.device:
            inv, self.magnitude = _inv_freq(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
            self.inv_freq = inv.to(positions.device)
        angles = positions.float()[..., None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return (angles.cos() * self.magnitude).to(dtype), (angles.sin() * self.magnitude).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, head_dim]; cos/sin [..., head_dim] (broadcast over heads)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


class DSparkAttention(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        width, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, width, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., n, width] -> roped k and v, each [..., n, kv_heads, head_dim]."""
        shape = (*x.shape[:-1], self.kv_heads, self.head_dim)
        k = apply_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin)
        return k, self.v_proj(x).view(shape)

    def forward(self, block: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, ctx_mask: torch.Tensor) -> torch.Tensor:
        """block [b, B, width] at cos/sin [b, B, head_dim]; the context's roped k/v [b, C, kv_heads, head_dim]
        with ctx_mask [b, C] (False: padding). The block sees the context and all of itself."""
        b, n = block.shape[:2]
        q = apply_rope(self.q_norm(self.q_proj(block).view(b, n, self.heads, self.head_dim)), cos, sin)
        k_blk, v_blk = self.key_value(block, cos, sin)
        k = torch.cat([ctx_k, k_blk], dim=1).transpose(1, 2)
        v = torch.cat([ctx_v, v_blk], dim=1).transpose(1, 2)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        visible = torch.cat([ctx_mask, ctx_mask.new_ones(b, n)], dim=1)[:, None, None, :]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class DSparkMLP(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"DSpark drafter: hidden_act {cfg.hidden_act!r} is not supported (silu only).")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DSparkLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.self_attn = DSparkAttention(cfg)
        self.mlp = DSparkMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, block: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, ctx_mask: torch.Tensor) -> torch.Tensor:
        block = block + self.self_attn(self.input_layernorm(block), cos, sin, ctx_k, ctx_v, ctx_mask)
        return block + self.mlp(self.post_attention_layernorm(block))


class MarkovHead(nn.Module):
    """A logit bias for each slot from the token before it: W2 applied to a rank-r state of that token."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.kind, rank = cfg.markov_head_type, cfg.markov_rank
        self.markov_w1 = nn.Embedding(cfg.vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, cfg.vocab_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(cfg.hidden_size + rank, rank)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + cfg.hidden_size, 3 * rank)

    def initial_state(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rnn head's recurrent state before slot 0 ([b, r] zeros; unused by the other kinds)."""
        return hidden.new_zeros(hidden.shape[0], self.markov_w1.embedding_dim)

    def step(self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """prev [b] token ids before the slot, hidden [b, width] the slot's; -> bias [b, vocab], new state."""
        e = self.markov_w1(prev)
        if self.kind == "vanilla":
            return self.markov_w2(e), state
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, e], dim=-1)))
            return self.markov_w2(gate * e), state
        gate, candidate, output = self.joint_proj(torch.cat([state, e, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(output)), state


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDrafter(nn.Module):
    """Qwen3DSparkModel's modules under its names (so DeepSpec's safetensors load as they are)."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.cfg, self.rope = cfg, Rope(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DSparkLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.markov_head = MarkovHead(cfg) if cfg.markov_rank > 0 else None
        self.confidence_head = None
        if cfg.enable_confidence_head:
            extra = cfg.markov_rank if cfg.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(cfg.hidden_size + extra)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """features [n, layers * width] of the target at `positions` [n] -> per drafter layer, roped k and v
        [n, kv_heads, head_dim]: all a request's context ever costs (computed once, then cached)."""
        context = self.hidden_norm(self.fc(features))
        cos, sin = self.rope(positions, context.dtype)
        return [layer.self_attn.key_value(context, cos, sin) for layer in self.layers]

    def block_hidden(self, anchors_embedded: torch.Tensor, mask_embedded: torch.Tensor, starts: torch.Tensor,
                     ctx: list[tuple[torch.Tensor, torch.Tensor]], ctx_mask: torch.Tensor) -> torch.Tensor:
        """The block pass: anchors [b, width] embedded, the mask token's embedding [width], each anchor's
        position `starts` [b]; per layer the context's k/v [b, C, kv_heads, head_dim] (mask [b, C]).
        Returns [b, block_size, width] after the final norm: slot i predicts the token at start + i + 1."""
        b, size = anchors_embedded.shape[0], self.cfg.block_size
        block = torch.cat([anchors_embedded[:, None], mask_embedded.expand(b, size - 1, -1)], dim=1)
        positions = starts[:, None] + torch.arange(size, device=starts.device)
        cos, sin = self.rope(positions, block.dtype)
        for layer, (k, v) in zip(self.layers, ctx):
            block = layer(block, cos, sin, k, v, ctx_mask)
        return self.norm(block)

    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """P(slot's token survives | the ones before it): hidden [b, width], prev [b] the token before it."""
        features = hidden
        if self.cfg.confidence_head_with_markov:
            features = torch.cat([hidden, self.markov_head.markov_w1(prev).to(hidden.dtype)], dim=-1)
        return torch.sigmoid(self.confidence_head(features).float())


def _read_config(path: str) -> dict:
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path!r} is not a DSpark checkpoint ({CONFIG_FILE} unreadable: {e}).") from None


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    """The safetensors of a save_pretrained directory: one file or shards with an index."""
    from safetensors.torch import load_file
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, WEIGHTS_FILE)):
        shards = [WEIGHTS_FILE]
    else:
        raise ValueError(f"DSpark drafter {path!r} has no {WEIGHTS_FILE} or {INDEX_FILE}.")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(os.path.join(path, shard)))
    return weights


def load_drafter(path: str) -> tuple[DSparkDrafter, set[str]]:
    """The drafter at `path` and the names of the tensors it left out (of `SHARED_WITH_TARGET`: the target's
    own stand in). Any other missing or unexpected tensor is refused by name."""
    cfg = DSparkConfig.from_hf(_read_config(path), path)
    with torch.device("meta"):
        drafter = DSparkDrafter(cfg)
    weights = _read_weights(path)
    expected = set(drafter.state_dict())
    if cfg.enable_confidence_head and not any(k.startswith("confidence_head.") for k in weights):
        raise ValueError(f"DSpark drafter {path!r} has no confidence head: enable_confidence_head is set but "
                         "confidence_head.proj.* is not in its weights.")
    missing = sorted(expected - set(weights) - set(SHARED_WITH_TARGET))
    unexpected = sorted(set(weights) - expected)
    if missing or unexpected:
        raise ValueError(f"DSpark drafter {path!r} does not match its {CONFIG_FILE}: "
                         + "; ".join(f"{what} {', '.join(names[:6])}" + (" ..." if len(names) > 6 else "")
                                     for what, names in (("missing", missing), ("unexpected", unexpected)) if names))
    for name, tensor in weights.items():
        want = drafter.state_dict()[name].shape
        if tuple(tensor.shape) != tuple(want):
            raise ValueError(f"DSpark drafter {path!r}: {name} is {tuple(tensor.shape)}, its config says "
                             f"{tuple(want)}.")
    absent = set(SHARED_WITH_TARGET) - set(weights)
    for name in absent:  # placeholders until the proposer ties them to the target's
        weights[name] = torch.empty(drafter.state_dict()[name].shape)
    drafter.load_state_dict(weights, assign=True)
    return drafter, absent


def check_against_target(cfg: DSparkConfig, hf, path: str, num_speculative_tokens: int,
                         last_layer: bool = False) -> None:
    """Refuses at start a drafter made for another target, or asked for more drafts than its block holds.
    `last_layer`: the target's last layer may be read (its tap is not the normed output HF reports for it)."""
    if cfg.hidden_size != hf.hidden_size or cfg.vocab_size != hf.vocab_size:
        raise ValueError(f"The DSpark drafter at {path!r} was made for a target of hidden size {cfg.hidden_size} "
                         f"and vocabulary {cfg.vocab_size}, not {hf.hidden_size} and {hf.vocab_size}.")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise ValueError(f"The DSpark drafter at {path!r}: mask_token_id {cfg.mask_token_id} is outside its "
                         f"vocabulary of {cfg.vocab_size}.")
    depth = hf.num_hidden_layers
    if cfg.num_target_layers is not None and cfg.num_target_layers != depth:
        raise ValueError(f"The DSpark drafter at {path!r} was made for a target of {cfg.num_target_layers} "
                         f"layers (num_target_layers); this target has {depth}.")
    ids, readable = cfg.target_layer_ids, depth if last_layer else depth - 1
    # A plain target's last HF hidden state is after the final norm, which is not what the target hands over.
    if any(i < 0 or i >= readable for i in ids) or list(ids) != sorted(set(ids)):
        raise ValueError(f"The DSpark drafter at {path!r} reads target_layer_ids {list(ids)}; this target "
                         f"has layers 0..{depth - 1} and pressroom hands over layers 0..{readable - 1} "
                         "(strictly increasing; not -1, the embeddings"
                         + (")." if last_layer else ", nor the last layer)."))
    if num_speculative_tokens > cfg.block_size:
        raise ValueError(f"num_speculative_tokens {num_speculative_tokens} is above the DSpark drafter's "
                         f"block_size {cfg.block_size} ({path!r}): one pass drafts at most block_size tokens.")


class _Context:
    """One request's context: per drafter layer, the roped k/v of every verified position seen so far, in
    buffers that double as they fill. Positions count from the first one seen: RoPE only sees offsets."""
    __slots__ = ("k", "v", "n")

    def __init__(self) -> None:
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.n = 0

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        rows = kv[0][0].shape[0]
        if not self.k or self.n + rows > self.k[0].shape[0]:
            capacity = max(64, 2 * (self.n + rows))
            self.k = [self._grow(old, k, capacity) for old, (k, _) in zip(self.k or [None] * len(kv), kv)]
            self.v = [self._grow(old, v, capacity) for old, (_, v) in zip(self.v or [None] * len(kv), kv)]
        for buf, (k, _) in zip(self.k, kv):
            buf[self.n:self.n + rows] = k
        for buf, (_, v) in zip(self.v, kv):
            buf[self.n:self.n + rows] = v
        self.n += rows

    def _grow(self, old: torch.Tensor | None, like: torch.Tensor, capacity: int) -> torch.Tensor:
        new = like.new_empty(capacity, *like.shape[1:])
        if old is not None:
            new[:self.n] = old[:self.n]
        return new


class DSparkProposer(Proposer):
    """Drafts a block per request from the cached target context of its verified positions."""
    profile_context_len = 256  # context positions the block pass is timed over for the budget

    def __init__(self, config: SpeculativeConfig, target: ModelRunner) -> None:
        if not config.model:
            raise ValueError('speculative_config method "dspark" needs "model": the DSpark drafter\'s directory.')
        hf = target.model.config
        self.drafter, shared = load_drafter(config.model)
        cfg = self.drafter.cfg
        # A target with hyper-connections (DeepSeek-V4) hands over each aux layer's streams: collapsed to one
        # hidden state per layer here; its last layer's are taken before the hyper head and final norm, so the
        # last layer may be read (DeepSeek's own V4 DSpark reads layers 40-42 of 43).
        self.collapse = getattr(target.model, "collapse_streams", None)
        check_against_target(cfg, hf, config.model, config.num_speculative_tokens, last_layer=self.collapse is not None)
        if not cfg.enable_confidence_head:
            raise ValueError(f"The DSpark drafter at {config.model!r} has no confidence head "
                             "(enable_confidence_head is false): the adaptive budget reads its confidences.")
        self.drafter.to(device=target.device, dtype=target.dtype).eval()
        self.target, self.k = target, config.num_speculative_tokens
        self.embed = target.model.model.embed_tokens if "embed_tokens.weight" in shared else self.drafter.embed_tokens
        self.head = target.model.compute_logits if "lm_head.weight" in shared else self.drafter.lm_head
        self.contexts: dict[str, _Context] = {}
        self.generator = torch.Generator(device=target.device).manual_seed(3)

    # ---- what the runner hands over ----

    def aux_layers(self) -> tuple[int, ...]:
        return self.drafter.cfg.target_layer_ids

    @torch.inference_mode()
    def observe_features(self, req_id: str, rows: torch.Tensor) -> None:
        ctx = self.contexts.setdefault(req_id, _Context())
        if self.collapse is not None:
            rows = self.collapse(rows)
        positions = torch.arange(ctx.n, ctx.n + rows.shape[0], device=rows.device)
        ctx.append(self.drafter.context_kv(rows.to(self.target.dtype), positions))

    def forget(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self.contexts.pop(rid, None)

    # ---- drafting ----

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> dict[str, Draft]:
        wanted = [r for r in requests if r.max_drafts > 0 and r.req_id in self.contexts]
        if not wanted:
            return {}
        device = self.target.device
        anchors = torch.tensor([r.token_ids[-1] for r in wanted], device=device)
        hidden = self._block([self.contexts[r.req_id] for r in wanted], anchors)
        ks = [min(self.k, r.max_drafts) for r in wanted]
        temps = [0.0 if r.params.greedy else float(r.params.temperature) for r in wanted]
        tokens, probs, conf = self._draw(hidden[:, :max(ks)], anchors, temps)
        tokens, conf = tokens.tolist(), conf.tolist()
        return {r.req_id: Draft(tokens[b][:k], None if probs[b] is None else probs[b][:k], conf[b][:k])
                for b, (r, k) in enumerate(zip(wanted, ks))}

    def _block(self, contexts: list[_Context], anchors: torch.Tensor) -> torch.Tensor:
        """The block pass over requests whose contexts differ in length (padded, masked)."""
        longest = max(c.n for c in contexts)
        layers = []
        if len(contexts) == 1:  # one request: its buffers as they are, no padded copy
            c = contexts[0]
            layers = [(k[None, :c.n], v[None, :c.n]) for k, v in zip(c.k, c.v)]
        for li in range(len(self.drafter.layers) if len(contexts) > 1 else 0):
            k = contexts[0].k[li].new_zeros(len(contexts), longest, *contexts[0].k[li].shape[1:])
            v = torch.zeros_like(k)
            for b, c in enumerate(contexts):
                k[b, :c.n], v[b, :c.n] = c.k[li][:c.n], c.v[li][:c.n]
            layers.append((k, v))
        lengths = torch.tensor([c.n for c in contexts], device=anchors.device)
        mask = torch.arange(longest, device=anchors.device)[None] < lengths[:, None]
        mask_token = torch.tensor([self.drafter.cfg.mask_token_id], device=anchors.device)
        return self.drafter.block_hidden(self.embed(anchors), self.embed(mask_token)[0], lengths, layers, mask)

    def _draw(self, hidden: torch.Tensor, anchors: torch.Tensor, temps: list[float]
              ) -> tuple[torch.Tensor, list[torch.Tensor | None], torch.Tensor]:
        """Slot by slot, left to right: the base logits plus the Markov bias of the token drawn before
        (argmax for greedy rows, a sample at the row's temperature otherwise), and the slot's confidence.
        Returns tokens [b, k], per row the q each token was drawn from (None: greedy) and confidences [b, k]."""
        b, k = hidden.shape[:2]
        base = self.head(hidden.flatten(0, 1)).view(b, k, -1).float()
        markov = self.drafter.markov_head
        sampled = [i for i, t in enumerate(temps) if t > 0]
        temp = torch.tensor([temps[i] for i in sampled], device=hidden.device)[:, None]
        prev = anchors
        state = markov.initial_state(hidden[:, 0]) if markov is not None else None
        tokens, confidences, qs = [], [], []
        for i in range(k):
            logits = base[:, i]
            if markov is not None:
                bias, state = markov.step(prev, hidden[:, i], state)
                logits = logits + bias.float()
            confidences.append(self.drafter.confidence(hidden[:, i], prev))
            token = logits.argmax(-1)
            if sampled:
                q = torch.softmax(logits[sampled] / temp, dim=-1)
                token[sampled] = torch.multinomial(q, 1, generator=self.generator)[:, 0]
                qs.append(q)
            tokens.append(token)
            prev = token
        q_rows: list[torch.Tensor | None] = [None] * b
        if sampled:
            stacked = torch.stack(qs, dim=1)  # [sampled, k, vocab]
            for j, row in enumerate(sampled):
                q_rows[row] = stacked[j]
        return torch.stack(tokens, dim=1), q_rows, torch.stack(confidences, dim=1)

    # ---- costs the budget plans with ----

    @torch.inference_mode()
    def profile_decode_steps(self, counts: list[int]) -> list[tuple[int, float]]:
        """Seconds of one more draft position over that many requests: the LM head and the Markov step
        over that many slots (the block pass is shared by all positions)."""
        width = self.drafter.cfg.hidden_size
        markov = self.drafter.markov_head

        def slot(n: int) -> None:
            h = self._zeros(n, width)
            logits = self.head(h)
            if markov is not None:
                prev = torch.zeros(n, dtype=torch.long, device=h.device)
                logits = logits + markov.step(prev, h, markov.initial_state(h))[0]
            logits.argmax(-1)

        return [(n, self._best_time(lambda n=n: slot(n))) for n in counts]

    @torch.inference_mode()
    def profile_block_passes(self, counts: list[int]) -> list[tuple[int, float]]:
        """Seconds of the block pass over that many requests (a context of `profile_context_len`)."""
        cfg, c = self.drafter.cfg, self.profile_context_len

        def block(n: int) -> None:
            kv = [(self._zeros(n, c, cfg.num_key_value_heads, cfg.head_dim),
                   self._zeros(n, c, cfg.num_key_value_heads, cfg.head_dim)) for _ in self.drafter.layers]
            mask = torch.ones(n, c, dtype=torch.bool, device=self.target.device)
            starts = torch.full((n,), c, device=self.target.device)
            self.drafter.block_hidden(self._zeros(n, cfg.hidden_size), self._zeros(cfg.hidden_size), starts, kv, mask)

        return [(n, self._best_time(lambda n=n: block(n))) for n in counts]

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.target.dtype, device=self.target.device)

    def _best_time(self, fn) -> float:
        best = math.inf
        for _ in range(3):  # the first warms up
            synchronize(self.target.device)
            start = time.perf_counter()
            fn()
            synchronize(self.target.device)
            best = min(best, time.perf_counter() - start)
        return best
