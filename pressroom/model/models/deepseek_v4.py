"""DeepSeek-V4: shared-KV multi-query attention over a sliding window plus compressed entries (CSA, HCA),
manifold-constrained hyper-connections, and a mixture of experts routed by sqrt-softplus scores or by a hash of
the token id.

Attention (HF DeepseekV4Attention). Each layer projects one KV head (keys = values, normalised, the trailing
rope slice rotated, interleaved pairs) and queries through q_a / q_b (q_b's output normalised per head, no
weight). A query at position p reads jointly, in one softmax with a per-head sink logit:
- the K=V vectors of positions p - sliding_window + 1 .. p: a per-request ring (`V4WindowRing`, a RecurrentLayer:
  position p at row p % rows), so the per-token KV a request holds stays at one window whatever its context;
- in HCA layers every compressed entry w with w < (p + 1) // m' (all its tokens are at or before p);
- in CSA layers only the `index_topk` of its causal entries that the lightning indexer scores best.
Its output's rope slice is rotated back by its own position, then the grouped low-rank projection (o_a per
head group, o_b) mixes the heads. Sliding-only layers use the "main" rope, compressed layers the "compress" one
(compress_rope_theta, the config's YaRN) for queries, keys and entries alike.

Compressed entries. Entry w of a layer with rate m is a softmax-gated mix of the projected tokens of window w
(w * m .. w * m + m - 1; HCA), or of window w's second half-features and window w - 1's first half-features
(CSA's overlapping windows, width 2m, stride m; window -1 has weight 0), normalised (kv_norm) and rotated at
position w * m. They live in `CompressedKVCache`s (layers/compressed_kv.py) addressed through the tokens' block
tables: HCA's holds head_dim values per entry, CSA's head_dim + index_head_dim (the indexer's own compressed key
after the entry). The tokens of a window that has not closed yet, and for CSA the previous window's, are a
per-request state (`V4Compressor`, a RecurrentLayer): a ring of the last m (HCA) or 2m (CSA) tokens' projected
kv and gate (in the model dtype, as projected; mixed in fp32), token p at row p % ring. Each step appends a
request's tokens and writes every entry whose window closes (position % m == m - 1) into the cache; chunked
prefill, decodes and prefix-cache checkpoints (state copies at block boundaries) all go through the same code.

Hyper-connections keep hc_mult streams per token ([tokens, hc_mult, hidden], fp32 weights) between blocks; the
hyper head collapses them before the final norm. The experts use the clamped SwiGLU (`swiglu_limit`); the
first `hash_moe` layers pick experts by `tid2eid[input_id]`, the rest by sqrt-softplus scores plus a correction
bias; both weight the chosen experts by their renormalised scores times `routed_scaling_factor`.

On CUDA (`_device_attention`) every layer's attention is Triton (kernels/triton/v4_attention.py): the window's K=V
(from the ring as the step found it, then from the step's own K=V), the compressed entries (HCA: all causal; CSA:
the indexer's top-k, chosen on the device for the whole step) and the sink in one softmax per query; then the ring
takes the step's K=V (round by round: prefix-cache checkpoints copy it at their boundaries with the compressor's
rings). The compressor's decodes run on the device too
(every decode writes its ring row; one kernel mixes the entries of the windows that close, the other decodes exit
at once), so a decode step reads no host value and is captured into CUDA graphs. Prefill chunks still advance the
compressor request by request on the host. On the CPU the attention is torch (decodes batched, prefill chunks
request by request).

Tensor parallelism splits the attention heads evenly over the ranks, as DeepSeek V2/V3's (models/deepseek.py):
q_b_proj is column-parallel by heads, each rank keeps its heads' sinks and its head groups' rows of o_a_proj
(o_groups must divide by the ranks: a rank's heads are whole groups), and o_b_proj is row-parallel (its all-reduce
joins the groups). What every head shares is replicated: q_a_proj and its norm, the K=V head (kv_proj, kv_norm) and
the window's cache, the compressors and the lightning indexer with their caches and rings, so every rank writes
the same entries and picks the same top-k; so are the hyper-connections, the norms and the routers. The routed
experts are sliced or dealt out whole (expert parallelism; models/moe.py), their partial sums all-reduced; the
shared expert splits as a dense MLP. Checked on the CPU (gloo) only: the CUDA path takes each rank's heads through
the same kernels, untested over several GPUs.

FP8 checkpoints in DeepSeek's block form (`weight_scale_inv` per 128 x 128 block; model/quantization/fp8.py) keep
every linear layer in FP8 (q_a, q_b, kv, o_b, the compressors' and the indexer's projections, the shared expert) and
the routed experts too (`Fp8MoeMethod`, the clamped SwiGLU included); modules_to_not_convert keeps the ones it names
dense. o_a_proj, a grouped einsum and no linear layer, is dequantized at load, as V3's kv_b_proj is: the FP8 layers
multiply one matrix, and o_a is a small share of the weights. What DeepSeek leaves dense (embeddings, head, routers,
the indexer's weights_proj, norms, hyper-connections, sinks, position biases, tid2eid) has no scale and loads as
shipped. The FP8 method asks `checkpoint_target` with the checkpoint's own names, so it canonicalises them first.
Scales named `.scale` (DeepSeek's inference code's name) are refused, naming the tensor.

The paged blocks hold only the compressed entries (a rate-th of the tokens); the MTP drafter's layer
(spec_decode/mtp_v4.py) keeps its window in a paged cache of its own (`window_ring=False`): the proposer keeps no
recurrent state.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.attention.backend import AttentionMetadata, get_attention_metadata, get_state_metadata
from pressroom.attention.state import StateRound
from pressroom.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from pressroom.kernels.moe_activation import LimitedSwiglu
from pressroom.model.layers import state as state_layers
from pressroom.model.layers.attention import Attention
from pressroom.model.layers.compressed_kv import CompressedKVCache
from pressroom.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pressroom.model.layers.fused_moe import DOWN, GATE, UP
from pressroom.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from pressroom.model.layers.norm import RMSNorm
from pressroom.model.layers.rotary import _inv_freq
from pressroom.model.layers.state import RecurrentLayer, StateShape
from pressroom.model.lazy_weight import materialize
from pressroom.model.models.deepseek import ReplicatedLinear, heads_per_rank
from pressroom.model.models.llama import LlamaMLP
from pressroom.model.models.moe import _rank_experts
from pressroom.model.weights import expected_names, load_named_weights

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


# ---- rope: interleaved pairs on the trailing slice of a head ----

class InterleavedRope(nn.Module):
    """cos/sin per position computed on the fly (V4's contexts reach 1M positions: no table)."""

    def __init__(self, rope_dim: int, params: dict) -> None:
        super().__init__()
        scaling = params if params.get("rope_type", "default") != "default" else None
        inv, self.magnitude = _inv_freq(rope_dim, params["rope_theta"], scaling)
        self.register_buffer("inv_freq", inv, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, rope_dim / 2] each, fp32."""
        freqs = positions.float()[:, None] * self.inv_freq
        return freqs.cos() * self.magnitude, freqs.sin() * self.magnitude


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, ..., dim] with its last 2 * cos.shape[-1] dims rotated as interleaved pairs (in fp32);
    cos, sin [tokens, rope / 2]. The inverse rotation: pass -sin."""
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    rope = x[..., -2 * half:].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-2 * half], rotated), dim=-1)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


# ---- the compressors: per-request rings of pending tokens, entries written into a paged cache ----

class V4Compressor(RecurrentLayer):
    """One layer's compressor (and, in CSA layers, the indexer's compressor beside it, over the same windows):
    projects every token's kv and gate, advances each request's ring of pending tokens and writes the entries of
    the windows that close into `cache` (CSA: [entry | indexer key] per slot)."""

    def __init__(self, config, layer_type: str, rope: InterleavedRope) -> None:
        super().__init__()
        self.rate = config.compress_rates[layer_type]
        self.overlap = layer_type == CSA
        self.head_dim, eps = config.head_dim, config.rms_norm_eps
        width = 2 if self.overlap else 1  # CSA: two series per token, Ca (next entry) and Cb (its own entry)
        hidden = config.hidden_size
        self.width = width * self.head_dim  # projected features per token
        self.kv_proj = ReplicatedLinear(hidden, self.width)
        self.gate_proj = ReplicatedLinear(hidden, self.width)
        self.position_bias = nn.Parameter(torch.zeros(self.rate, self.width, dtype=torch.float32),
                                          requires_grad=False)
        self.kv_norm = RMSNorm(self.head_dim, eps)
        self.rope = rope
        self.indexer = V4Indexer(config, self.rate) if self.overlap else None
        entry_dim = self.head_dim + (self.indexer.head_dim if self.indexer is not None else 0)
        self.cache = CompressedKVCache(entry_dim, self.rate)
        self.ring = (2 if self.overlap else 1) * self.rate  # rows by position mod ring: whole windows
        # the projections' own dtype: a ring holds them as they come (the mixing runs in fp32)
        self.ring_dtype = torch.get_default_dtype()

    def state_shapes(self) -> dict[str, StateShape]:
        shapes = {"kv": StateShape((self.ring, self.width), self.ring_dtype),
                  "gate": StateShape((self.ring, self.width), self.ring_dtype)}
        if self.indexer is not None:
            width = 2 * self.indexer.head_dim
            shapes |= {"index_kv": StateShape((self.ring, width), self.ring_dtype),
                       "index_gate": StateShape((self.ring, width), self.ring_dtype)}
        return shapes

    def reserve_draft_rows(self, num_drafts: int) -> None:
        """Rows go by position (mod ring), so a step of drafts the target then rejects only wrote rows of
        positions computed again the next step, and entries of windows no query reads before they are written
        again: nothing to roll back, as long as those writes miss the rows of the pending windows. So the ring
        grows by the drafts, to whole windows (which the decode kernel reads without wrapping)."""
        needed = (2 if self.overlap else 1) * self.rate + num_drafts
        self.ring = -(-needed // self.rate) * self.rate

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, block_size: int) -> None:
        """Writes the entries of every window the step's tokens close."""
        tokens = [self.kv_proj(x), self.gate_proj(x)]
        if self.indexer is not None:
            tokens += [self.indexer.kv_proj(x), self.indexer.gate_proj(x)]
        slots = self.cache.slots_of_tokens(meta.slot_mapping, block_size)
        self.run_rounds(self._mix, positions, slots, *tokens)

    def _parts(self) -> list[tuple[torch.Tensor, int, RMSNorm]]:
        """(position bias, head dim, norm) of the compressor's series: the entry's, then the indexer key's."""
        parts = [(self.position_bias, self.head_dim, self.kv_norm)]
        if self.indexer is not None:
            parts.append((self.indexer.position_bias, self.indexer.head_dim, self.indexer.kv_norm))
        return parts

    def _mix(self, r: StateRound, positions: torch.Tensor, slots: torch.Tensor, *tokens: torch.Tensor
             ) -> torch.Tensor:
        names, parts, decodes, loc = list(self.state_shapes()), self._parts(), r.num_decodes, r.query_start_loc
        empty = tokens[0].new_empty(tokens[0].shape[0], 0)
        first_request = 0
        if decodes and state_layers.on_triton(tokens[0]):  # no host value decides anything: CUDA graphs capture this
            self._decode_on_device(r.slots[:decodes], positions[:decodes], slots[:decodes],
                                   [t[:decodes] for t in tokens])
            first_request = decodes
            if decodes == len(loc) - 1:
                return empty
        elif decodes:  # one token each: into the rings at once; only those that close a window go on below
            for name, t in zip(names, tokens):
                self.states[name][r.slots[:decodes], positions[:decodes] % self.ring] = t[:decodes]
        pos, request_slots = positions.tolist(), r.slots.tolist()
        for i in range(first_request, len(loc) - 1):
            start, end = loc[i], loc[i + 1]
            if start == end or i < decodes and pos[start] % self.rate != self.rate - 1:
                continue
            slot = request_slots[i]
            first, stop = pos[start], pos[end - 1] + 1
            closing = torch.arange(first // self.rate, stop // self.rate, device=positions.device)
            entries = []
            for j, (bias, dim, norm) in enumerate(parts):
                kv_ring, gate_ring = self.states[names[2 * j]][slot], self.states[names[2 * j + 1]][slot]
                kv, gate, base = self._history(kv_ring, gate_ring, tokens[2 * j][start:end],
                                               tokens[2 * j + 1][start:end], first, stop)
                if len(closing):
                    entries.append(self._entries(kv, gate + bias[self._offsets(base, stop)], base, closing, dim,
                                                 norm))
            if len(closing):
                self.cache.write(slots[start + (closing * self.rate + self.rate - 1 - first)], torch.cat(entries, -1))
        return empty

    def _decode_on_device(self, state_slots: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                          tokens: list[torch.Tensor]) -> None:
        """Decodes (one token each): every one writes its projections into its ring row; those that close a window
        (and are no padding row: slot -1) mix its entry (kernels/triton/v4_attention.py) and store it."""
        from pressroom.kernels.triton.cache import write_kv
        from pressroom.kernels.triton.v4_attention import mix_closing_windows
        m, names = self.rate, list(self.state_shapes())
        for name, t in zip(names, tokens):
            self.states[name][state_slots, positions % self.ring] = t
        targets = torch.where(positions % m == m - 1, slots, -1)
        cos, sin = self.rope.cos_sin(torch.div(positions, m, rounding_mode="floor") * m)
        entries = []
        for j, (bias, dim, norm) in enumerate(self._parts()):
            mixed = mix_closing_windows(self.states[names[2 * j]], self.states[names[2 * j + 1]], bias, state_slots,
                                        positions, targets, dim, self.overlap)
            entries.append(rotate_tail(norm(mixed.to(norm.weight.dtype)), cos, sin))
        write_kv(self.cache.kv_cache, torch.cat(entries, -1).unsqueeze(1), None, targets)

    def _offsets(self, base: int, stop: int) -> torch.Tensor:
        return torch.arange(base, stop, device=self.position_bias.device) % self.rate

    def _history(self, kv_ring: torch.Tensor, gate_ring: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor,
                 first: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A request's projections of positions base .. stop - 1 (the pending ones from the ring, then the new
        ones) in fp32, base the start of the first window a new entry reads; the ring keeps the last of them."""
        window = first // self.rate * self.rate
        base = max(0, window - self.rate) if self.overlap else window
        old = torch.arange(base, first, device=kv.device) % self.ring
        kv, gate = torch.cat((kv_ring[old], kv)), torch.cat((gate_ring[old], gate))
        keep = torch.arange(max(base, stop - self.ring), stop, device=kv.device)
        kv_ring[keep % self.ring] = kv[keep - base]
        gate_ring[keep % self.ring] = gate[keep - base]
        return kv.float(), gate.float(), base

    def _entries(self, kv: torch.Tensor, gate: torch.Tensor, base: int, windows: torch.Tensor, dim: int,
                 norm: RMSNorm) -> torch.Tensor:
        """Entries of `windows` from positions base .. (kv, gate [positions, width * dim], gate biased):
        normalised and rotated at each window's first position."""
        m = self.rate
        rows = (windows * m - base)[:, None] + torch.arange(m, device=kv.device)  # [windows, m]
        if self.overlap:  # window w - 1's Ca beside window w's Cb; the window before 0 weighs nothing
            prev = (rows - m).clamp(min=0)
            kv_w = torch.cat((kv[prev][..., :dim], kv[rows][..., dim:]), dim=1)
            prev_gate = gate[prev][..., :dim].masked_fill((windows == 0)[:, None, None], float("-inf"))
            gate_w = torch.cat((prev_gate, gate[rows][..., dim:]), dim=1)
        else:
            kv_w, gate_w = kv[rows], gate[rows]
        mixed = (kv_w * gate_w.softmax(dim=1)).sum(dim=1)
        mixed = norm(mixed.to(norm.weight.dtype).contiguous())
        return rotate_tail(mixed, *self.rope.cos_sin(windows * m))


class V4WindowRing(RecurrentLayer):
    """A layer's K=V vectors of a request's last positions, position p at row p % rows: all the per-token KV a V4
    layer reads is its sliding window's, so it is a fixed-size state per request, not paged blocks that would grow
    with the context (only the compressed entries, a rate-th of the tokens, are paged). A step's queries read the
    ring as the step found it (positions before the request's first token in the step) and the step's own K=V;
    `append` then keeps each request's last rows, round by round, so a prefix-cache checkpoint holds the window
    at its boundary."""

    def __init__(self, window: int, dim: int) -> None:
        super().__init__()
        self.window, self.dim, self.rows = window, dim, window
        self.dtype = torch.get_default_dtype()  # the model's, as the K=V come

    def state_shapes(self) -> dict[str, StateShape]:
        return {"kv": StateShape((self.rows, self.dim), self.dtype)}

    def reserve_draft_rows(self, num_drafts: int) -> None:
        """Drafts the target rejects wrote rows of positions that the next step reads from its own K=V (never
        from the ring); with window + drafts rows those writes miss every row a later window reads."""
        self.rows = self.window + num_drafts

    @property
    def kv(self) -> torch.Tensor:
        return self.states["kv"]

    def keys(self, slots: torch.Tensor, first: torch.Tensor, count: int) -> torch.Tensor:
        """[b, count, dim]: the rows of positions first .. first + count - 1 of the requests at `slots` [b]
        (first [b]); a negative position reads some row (its caller masks it)."""
        pos = first[:, None] + torch.arange(count, device=first.device)
        return self.kv[slots[:, None], pos % self.rows]

    def append(self, positions: torch.Tensor, kv: torch.Tensor) -> None:
        self.run_rounds(self._append, positions, kv)

    def _append(self, r: StateRound, positions: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """A round's K=V into its requests' rings: a decode's one row (no host value: CUDA graphs capture it),
        a longer segment's last `rows`."""
        decodes, loc = r.num_decodes, r.query_start_loc
        kv = kv.to(self.dtype)
        if decodes:
            self.kv[r.slots[:decodes], positions[:decodes] % self.rows] = kv[:decodes]
        for i in range(decodes, len(loc) - 1):
            keep = slice(max(loc[i], loc[i + 1] - self.rows), loc[i + 1])
            self.kv[r.slots[i], positions[keep] % self.rows] = kv[keep]
        return kv[:, :0]


class V4Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its compressor's projections (run by V4Compressor) and its scoring
    head; a query's score for entry s is sum_h w_h * relu(q_h . k_s) / sqrt(dim), w_h from weights_proj."""

    def __init__(self, config, rate: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        hidden = config.hidden_size
        self.kv_proj = ReplicatedLinear(hidden, 2 * self.head_dim)
        self.gate_proj = ReplicatedLinear(hidden, 2 * self.head_dim)
        self.position_bias = nn.Parameter(torch.zeros(rate, 2 * self.head_dim, dtype=torch.float32),
                                          requires_grad=False)
        self.kv_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.q_b_proj = ReplicatedLinear(config.q_lora_rank, self.heads * self.head_dim)
        self.weights_proj = nn.Linear(hidden, self.heads, bias=False)
        self.weights_proj.requires_grad_(False)

    def queries(self, q_resid: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated queries [tokens, heads, dim] (fp32) and head weights [tokens, heads]."""
        q = rotate_tail(self.q_b_proj(q_resid).view(-1, self.heads, self.head_dim), cos, sin)
        return q.float(), self.weights_proj(x).float() * self.heads ** -0.5

    def choose(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
               ) -> torch.Tensor:
        """Which of the entries `keys` [1 or queries, entries, dim] each query reads: [queries, entries] bool, the
        best index_topk of its `visible` (causal) ones."""
        scores = torch.relu(torch.matmul(q, keys.float().transpose(1, 2))) * self.head_dim ** -0.5
        index = (scores * weights.unsqueeze(-1)).sum(dim=1).masked_fill(~visible, float("-inf"))
        chosen = index.topk(min(self.topk, keys.shape[1]), dim=-1).indices
        picked = torch.zeros_like(visible).scatter_(1, chosen, True)
        return picked & visible


# ---- attention ----

def _load_rank_rows(param: nn.Parameter, loaded: Any, start: int, total: int) -> None:
    """Rows start .. start + len(param) of a checkpoint tensor of `total` rows: this rank's heads' or groups'."""
    expected = (total, *param.shape[1:])
    if tuple(loaded.shape) != expected:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)} where the model config implies "
                         f"{expected}; the checkpoint and config.json disagree.")
    param.data.copy_(materialize(loaded.narrow(0, start, param.shape[0])))


def groups_per_rank(groups: int, tp_size: int) -> int:
    """o_a's head groups each tensor-parallel rank holds (whole groups: its heads are whole groups of heads)."""
    if groups % tp_size:
        raise ValueError(f"o_groups ({groups}) is not divisible by tensor_parallel_size ({tp_size}): DeepSeek-V4's "
                         "grouped output projection splits its groups evenly over the ranks; choose a "
                         f"tensor_parallel_size that divides {groups}.")
    return groups // tp_size


class GroupedLinear(nn.Module):
    """o_a: each of `groups` head groups projected on its own ([groups * rank, in / groups] in the checkpoint).
    Under tensor parallelism this rank's `groups` of `total_groups`, from group `first`."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int, total_groups: int, first: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out_per_group, in_per_group), requires_grad=False)
        self.weight.weight_loader = lambda param, loaded, shard=None: _load_rank_rows(
            param, loaded, first * out_per_group, total_groups * out_per_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, groups, in / groups] -> [tokens, groups * rank]."""
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])
        return torch.einsum("tgi,gri->tgr", x, w).flatten(1)


class V4Attention(nn.Module):
    def __init__(self, config, layer_type: str, ropes: dict[str, InterleavedRope], window_ring: bool = True
                 ) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.rope = ropes["main" if self.layer_type == SLIDING else "compress"]
        # tensor parallelism: this rank's heads (whole o_a groups of them); the query latent, the K=V head, the
        # window's cache and the compressors are the same on every rank
        tp, rank, total_heads = get_tp_size(), get_tp_rank(), config.num_attention_heads
        self.num_heads, self.head_dim = heads_per_rank(total_heads, tp), config.head_dim
        self.groups = groups_per_rank(config.o_groups, tp)
        self.eps, self.window = config.rms_norm_eps, config.sliding_window
        hidden, heads, dim = config.hidden_size, self.num_heads, self.head_dim
        self.q_a_proj = ReplicatedLinear(hidden, config.q_lora_rank)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, total_heads * dim)  # by heads: an even split
        self.kv_proj = ReplicatedLinear(hidden, dim)
        self.kv_norm = RMSNorm(dim, config.rms_norm_eps)
        self.o_a_proj = GroupedLinear(heads * dim // self.groups, config.o_lora_rank, self.groups, config.o_groups,
                                      rank * self.groups)
        self.o_b_proj = RowParallelLinear(config.o_groups * config.o_lora_rank, hidden)  # by groups: even
        self.sinks = nn.Parameter(torch.zeros(heads, dtype=torch.float32), requires_grad=False)
        self.sinks.weight_loader = lambda param, loaded, shard=None: _load_rank_rows(param, loaded, rank * heads,
                                                                                      total_heads)
        self.scale = dim ** -0.5
        if window_ring:
            self.window_ring = V4WindowRing(self.window, dim)
        else:  # the MTP drafter's layer (sliding only) keeps its window in a paged cache of the proposer's
            if layer_type != SLIDING:
                raise ValueError("only a sliding-window V4 layer keeps its window in a paged cache")
            self.window_ring = None
            self.attn = Attention(heads, dim, 1, self.scale, latent=True, sliding_window=self.window)
        self.compressor = None if self.layer_type == SLIDING else V4Compressor(config, self.layer_type,
                                                                               ropes["compress"])

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        cos, sin = self.rope.cos_sin(positions)
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_resid).view(tokens, self.num_heads, self.head_dim), self.eps)
        q = rotate_tail(q, cos, sin)
        kv = rotate_tail(self.kv_norm(self.kv_proj(x)), cos, sin)
        if state_layers.on_triton(q):
            out = self._device_attention(q, kv, q_resid, x, positions, cos, sin)
        elif self.window_ring is None:
            out = self.attn(q, kv.unsqueeze(1), sinks=self.sinks).view(tokens, self.num_heads, self.head_dim)
        else:
            out = self._ring_attention(q, kv, q_resid, x, positions, cos, sin)
        out = rotate_tail(out, cos, -sin)
        return self.o_b_proj(self.o_a_proj(out.reshape(tokens, self.groups, -1)))

    def _device_attention(self, q: torch.Tensor, kv: torch.Tensor, q_resid: torch.Tensor, x: torch.Tensor,
                          positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Triton (kernels/triton/v4_attention.py), every query of the step at once from device tensors only: the
        compressor advanced, the indexer's choice made, one joint softmax per query over the window (the ring as
        the step found it, then the step's own K=V) and the entries; then the ring takes the step's K=V."""
        from pressroom.kernels.triton.dsa import token_positions
        from pressroom.kernels.triton.v4_attention import choose_entries, entry_table, v4_attention
        meta = get_attention_metadata()
        starts = meta.query_start_loc_device
        if starts is None:  # a CPU backend's metadata (the interpreter's tests)
            starts = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=q.device)
        token_req, token_pos = token_positions(starts, meta.seq_lens, q.shape[0])
        common = dict(token_req=token_req, token_pos=token_pos, sinks=self.sinks, window=self.window,
                      scale=self.scale)
        if self.window_ring is None:  # the MTP drafter's layer: its window in a paged cache
            from pressroom.kernels.triton.cache import write_kv
            write_kv(self.attn.kv_cache, kv.unsqueeze(1), None, meta.slot_mapping)
            return v4_attention(q, paged=(self.attn.kv_cache, meta.block_tables), **common)
        entries = chosen = None
        if self.compressor is not None:
            cache = self.compressor.cache
            self.compressor(x, positions, meta, cache.block_size)
            entries = (cache.kv_cache, *entry_table(meta.block_tables, cache.rate, cache.block_size), cache.rate)
            indexer = self.compressor.indexer
            if indexer is not None:
                index_q, index_w = indexer.queries(q_resid, x, cos, sin)
                chosen = choose_entries(index_q, index_w, entries, token_req, token_pos, self.head_dim,
                                        indexer.topk)
        kv = kv.to(self.window_ring.dtype)  # the kernel reads the step's rows and the ring's alike
        ring = (self.window_ring.kv, get_state_metadata().slots_of_requests(), starts, kv)
        out = v4_attention(q, ring=ring, entries=entries, chosen=chosen, **common)
        self.window_ring.append(positions, kv)
        return out

    def _ring_attention(self, q: torch.Tensor, kv: torch.Tensor, q_resid: torch.Tensor, x: torch.Tensor,
                        positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Torch: the decodes batched, then the other requests one by one over the host's query starts; each query
        reads its window (the ring as the step found it, then the step's own K=V) and its causal (CSA: chosen)
        compressed entries in one softmax with the sink. Then the ring takes the step's K=V."""
        meta, ring, window = get_attention_metadata(), self.window_ring, self.window
        slots = get_state_metadata().slots_of_requests()
        index_q = index_w = None
        if self.compressor is not None:
            self.compressor(x, positions, meta, self.compressor.cache.block_size)
            if self.compressor.indexer is not None:
                index_q, index_w = self.compressor.indexer.queries(q_resid, x, cos, sin)
        new = kv.to(ring.dtype)
        out = torch.empty_like(q)
        decodes = meta.num_decodes
        if decodes:
            query_pos = positions[:decodes]
            keys = torch.cat((ring.keys(slots[:decodes], query_pos - window + 1, window - 1),
                              new[:decodes, None]), dim=1)
            seen = query_pos[:, None] - window + 1 + torch.arange(window, device=q.device) >= 0
            out[:decodes] = self._attend_rows(q[:decodes], keys, seen, meta.block_tables[:decodes], query_pos,
                                              max(meta.seq_lens_host[:decodes]),
                                              *(None if t is None else t[:decodes] for t in (index_q, index_w)))
        loc, lens = meta.query_start_loc, meta.seq_lens_host
        for i in range(decodes, len(loc) - 1):
            start, end, context = loc[i], loc[i + 1], lens[i]
            if start == end:
                continue
            first = context - (end - start)
            old = min(first, window - 1)  # positions before the step that its first query sees
            keys = torch.cat((ring.keys(slots[i:i + 1], torch.tensor([first - old], device=q.device), old)[0],
                              new[start:end]))
            key_pos = torch.arange(first - old, context, device=q.device)
            query_pos = torch.arange(first, context, device=q.device)
            seen = (key_pos <= query_pos[:, None]) & (key_pos > query_pos[:, None] - window)
            rows = slice(start, end)
            out[rows] = self._attend_rows(q[rows], keys[None], seen, meta.block_tables[i:i + 1], query_pos, context,
                                          *(None if t is None else t[rows] for t in (index_q, index_w)))
        ring.append(positions, kv)
        return out

    def _attend_rows(self, q: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, tables: torch.Tensor,
                     query_pos: torch.Tensor, context: int, index_q: torch.Tensor | None,
                     index_w: torch.Tensor | None) -> torch.Tensor:
        """Queries q [n, heads, dim] at `query_pos` [n] over b = 1 (one request's queries) or n (one query per
        request) sequences: their window keys [b, k, dim] (`seen` [n, k]: which each query reads), block tables
        [b, blocks] (the compressed entries), `context` the longest sequence's length."""
        if self.compressor is None:
            return self._attend(q, keys, seen, keys[:, :0], seen[:, :0])
        cache, rate = self.compressor.cache, self.compressor.rate
        count = context // rate  # entries to read (more than a sequence has: masked)
        entries = cache.read(tables, count, cache.block_size)  # [b, count, entry]
        visible = torch.arange(count, device=q.device) < ((query_pos + 1) // rate)[:, None]
        if index_q is not None and count:
            visible = self.compressor.indexer.choose(index_q, index_w, entries[..., self.head_dim:], visible)
        return self._attend(q, keys, seen, entries[..., :self.head_dim], visible)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, key_mask: torch.Tensor, entries: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        """q [n, heads, dim]; keys [b, k, dim] and entries [b, e, dim] (b: 1 or n); masks [n, k] and [n, e]."""
        values = torch.cat((keys, entries), dim=1).to(q.dtype)
        mask = torch.cat((key_mask, visible), dim=1)
        logits = torch.matmul(q, values.transpose(1, 2)) * self.scale
        logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
        sinks = self.sinks.to(logits.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)
        logits = torch.cat((logits, sinks), dim=-1)
        probs = (logits - logits.max(dim=-1, keepdim=True).values).softmax(dim=-1)[..., :-1]
        return torch.matmul(probs, values)


# ---- hyper-connections ----

class HyperConnection(nn.Module):
    """mHC around one block: from the hc_mult streams, the weights that collapse them into the block's input
    (pre), spread its output over them (post) and mix them (comb, made doubly stochastic by Sinkhorn)."""

    def __init__(self, config) -> None:
        super().__init__()
        n = self.n = config.hc_mult
        self.iters, self.eps, self.norm_eps = config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        f32 = dict(dtype=torch.float32)
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * config.hidden_size, **f32), requires_grad=False)
        self.base = nn.Parameter(torch.zeros((2 + n) * n, **f32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3, **f32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [tokens, n, hidden] -> post [tokens, n], comb [tokens, n, n] (fp32), collapsed [tokens, hidden]."""
        n = self.n
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre_w, post_w, comb_w = F.linear(flat, self.fn).split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after the block: its output spread by post, plus the input streams mixed by comb."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                streams)


class HyperHead(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        n = config.hc_mult
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        f32 = dict(dtype=torch.float32)
        self.hc_fn = nn.Parameter(torch.zeros(n, n * config.hidden_size, **f32), requires_grad=False)
        self.hc_base = nn.Parameter(torch.zeros(n, **f32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.ones(1, **f32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


# ---- mixture of experts ----

class ClampedSiluAndMul(nn.Module):
    """The shared expert's activation over [gate | up]."""

    def __init__(self, limit: float) -> None:
        super().__init__()
        self.act = LimitedSwiglu(limit)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.act(*gate_up.chunk(2, dim=-1))


class V4Router(nn.Module):
    """sqrt(softplus) scores; the experts chosen by score plus correction bias, or by `tid2eid[token]` (hash)."""

    def __init__(self, config, hashed: bool) -> None:
        super().__init__()
        self.top_k, self.scaling = config.num_experts_per_tok, config.routed_scaling_factor
        experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size), requires_grad=False)
        self.e_score_correction_bias = None
        if hashed:  # loaded by the model (an integer table is no parameter); distinct defaults for dummy weights
            self.register_buffer("tid2eid", torch.arange(self.top_k).repeat(config.vocab_size, 1) % experts)
        else:
            self.tid2eid = None
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32),
                                                        requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softplus(F.linear(x, self.weight).float()).sqrt()
        if self.tid2eid is not None:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, ids


class V4MoE(nn.Module):
    def __init__(self, config, hashed: bool) -> None:
        super().__init__()
        hidden, inter, limit = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        self.gate = V4Router(config, hashed)
        # this rank's experts, or slices of every one (models/moe.py); the shared expert splits as a dense MLP
        self.experts = _rank_experts(config.n_routed_experts, hidden, inter, activation=LimitedSwiglu(limit))
        self.shared_experts = LlamaMLP(hidden, inter, ClampedSiluAndMul(limit))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        return tp_all_reduce(self.experts(x, weights, ids)) + self.shared_experts(x)  # the shared one: reduced inside


# ---- the model ----

class V4DecoderLayer(nn.Module):
    def __init__(self, config, layer_type: str, hashed: bool, ropes: dict[str, InterleavedRope],
                 window_ring: bool = True) -> None:
        """`window_ring` False: the window's K=V in a paged cache (the MTP drafter's layer, see V4Attention)."""
        super().__init__()
        self.self_attn = V4Attention(config, layer_type, ropes, window_ring)
        self.mlp = V4MoE(config, hashed)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        streams = HyperConnection.merge(streams, self.self_attn(self.input_layernorm(x), positions), post, comb)
        post, comb, x = self.ffn_hc(streams)
        return HyperConnection.merge(streams, self.mlp(self.post_attention_layernorm(x), input_ids), post, comb)


class V4Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.hc_mult = config.hc_mult
        rope_dim = int(config.head_dim * config.partial_rotary_factor)
        ropes = {name: InterleavedRope(rope_dim, config.rope_parameters[name]) for name in ("main", "compress")}
        self.ropes = nn.ModuleDict(ropes)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        hashed = [kind == "hash_moe" for kind in config.mlp_layer_types]
        self.layers = nn.ModuleList(V4DecoderLayer(config, config.layer_types[i], hashed[i], ropes)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Hidden states; with `aux_layers` (a drafter's conditioning), also the streams after each of those
        layers, flattened ([tokens, hc_mult * hidden]: what the MTP layer reads)."""
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        taps = {}
        for i, layer in enumerate(self.layers):
            streams = layer(streams, positions, input_ids)
            if i in aux_layers:
                taps[i] = streams.flatten(1)
        hidden = self.norm(self.hc_head(streams))
        return (hidden, [taps[i] for i in aux_layers]) if aux_layers else hidden


# DeepSeek's checkpoint names (as DeepSeek ships them and as HF's save_pretrained writes them back) -> HF's module
# names, which ours follow; applied in order, like HF's conversion mapping for deepseek_v4.
_RENAMES = [(re.compile(p), r) for p, r in [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"), (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"), (r"\.attn_sink$", ".sinks"),
    (r"\.self_attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.weights_proj."),
    (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.scorer\.weights_proj\.", ".weights_proj."),
    (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.wq_b\.", ".q_b_proj."), (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
]]
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_EXPERT_PARTS = {"w1": ("w13", GATE), "w3": ("w13", UP), "w2": ("w2", DOWN)}
_SHARED = {".shared_experts.gate_proj.": 0, ".shared_experts.up_proj.": 1}


def _refuse_unread_scale(raw: str, name: str) -> None:
    """An FP8 scale the quantization method did not take: the config has no quantization_config (the FP8 values
    would load as plain numbers), or the scale is named `.scale` (DeepSeek's inference code's name, which the FP8
    method does not pair with its weight)."""
    if name.endswith(("weight_scale_inv", "weight_scale")):
        raise ValueError(f"{raw}: this checkpoint stores FP8 block-quantized weights, but its config.json has no "
                         "quantization_config (quant_method 'fp8', weight_block_size) to read them.")
    if name.endswith(".scale") and "_hc." not in name:
        raise ValueError(f"{raw}: FP8 scales named '.scale' are not read; rename them '.weight_scale_inv' (as "
                         "DeepSeek's HF checkpoints name them) and add quantization_config to config.json.")


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name in HF's module naming (with the `model.` prefix, lm_head outside it)."""
    name = name.removeprefix("model.")
    if name in ("head.weight", "lm_head.weight"):
        return "lm_head.weight"
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return "model." + name


class DeepseekV4ForCausalLM(nn.Module):
    cuda_graphs_supported = True  # on CUDA a decode step reads device tensors only (the compressors' too)
    applies_sliding_window = True  # contexts run past the window: its layers mask by it

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = V4Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        # the capacity a cache of every token's K=V in every layer would give (the start-up line's comparison)
        self.full_attention_kv_per_token = config.num_hidden_layers * config.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor:
        return self.model(input_ids, positions, aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def to_hf_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """bench gpu's HF names -> HF's modules: the indexer's head weights sit in its `scorer` there."""
        return {name.replace(".indexer.weights_proj.", ".indexer.scorer.weights_proj."): t for name, t in state.items()}

    def collapse_streams(self, aux: torch.Tensor) -> torch.Tensor:
        """Aux-layer features as `forward` hands them over ([tokens, layers * hc_mult * hidden]: each layer's
        streams) as one hidden state per layer ([tokens, layers * hidden]): the mean of its hc_mult streams,
        what DSpark drafters read of a V4 target (vLLM pools V4's aux layers the same way for DeepSeek's own)."""
        streams = aux.view(aux.shape[0], -1, self.config.hc_mult, self.config.hidden_size)
        return streams.float().mean(dim=2).to(aux.dtype).flatten(1)

    # ---- the name map (model/weights.py), over canonical names ----

    def skips(self, name: str) -> bool:
        return False

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """A tensor's parameter and shard; `name` canonical or as the checkpoint spells it (an FP8 method asks
        with the checkpoint's names which layer a weight loads into, before `checkpoint_tensors` renames it)."""
        name = canonical_name(name)
        m = _EXPERT.search(name)
        if m is not None:
            param, part = _EXPERT_PARTS[m.group(2)]
            return name[:m.start()] + f".mlp.experts.{param}", (part, int(m.group(1)))
        for part, shard in _SHARED.items():
            if part in name:
                return name.replace(part, ".shared_experts.gate_up_proj."), shard
        return name, None

    def checkpoint_parts(self, name: str) -> list[str]:
        experts = self.config.n_routed_experts
        for param, parts in (("w13", ("w1", "w3")), ("w2", ("w2",))):
            if name.endswith(f".mlp.experts.{param}"):
                block = name.removesuffix(f".experts.{param}")
                return [f"{block}.experts.{e}.{p}.weight" for e in range(experts) for p in parts]
        if ".shared_experts.gate_up_proj." in name:
            return [name.replace(".shared_experts.gate_up_proj.", part) for part in _SHARED]
        return [name]

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """Canonical names; HF-style fused experts split per expert; the MTP layers left out (the MTP drafter
        reads them itself)."""
        layers = self.config.num_hidden_layers
        for raw, tensor in weights:
            name = canonical_name(raw)
            _refuse_unread_scale(raw, name)
            parts = name.split(".")
            if parts[1] == "mtp" or parts[1] == "layers" and int(parts[2]) >= layers:
                continue
            if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                yield from self._split_experts(name, tensor)
                continue
            yield name, tensor

    def _split_experts(self, name: str, tensor: Any) -> Iterable[tuple[str, Any]]:
        """HF's fused [experts, 2 * inter, hidden] gate_up (gate first) or [experts, hidden, inter] down."""
        tensor = materialize(tensor)
        block = name.rsplit(".", 1)[0]
        if name.endswith("gate_up_proj"):
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{block}.{e}.w1.weight", tensor[e, :inter]
                yield f"{block}.{e}.w3.weight", tensor[e, inter:]
            return
        for e in range(tensor.shape[0]):
            yield f"{block}.{e}.w2.weight", tensor[e]

    def expected_weights(self) -> set[str]:
        return expected_names(self) | {f"{prefix}.tid2eid" for prefix in self._hash_routers()}

    def _hash_routers(self) -> dict[str, V4Router]:
        return {f"{name}": m for name, m in self.named_modules() if isinstance(m, V4Router) and m.tid2eid is not None}

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        routers, tables, current = self._hash_routers(), {}, [""]

        def tensors():
            for raw, tensor in weights:
                current[0] = raw
                for name, part in self.checkpoint_tensors([(raw, tensor)]):
                    if name.endswith(".tid2eid"):
                        tables[name] = tensor
                        continue
                    yield name, part

        try:
            loaded = load_named_weights(self, tensors())
        except ValueError as e:  # the model's name for it first, then the checkpoint's own
            raise ValueError(f"{e} (checkpoint tensor {current[0]!r})") from None
        for name, tensor in tables.items():
            router = routers.get(name.removesuffix(".tid2eid"))
            if router is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in DeepseekV4ForCausalLM.")
            self._load_hash_table(name, router, materialize(tensor))
            loaded.add(name)
        return loaded

    def _load_hash_table(self, name: str, router: V4Router, table: torch.Tensor) -> None:
        expected = tuple(router.tid2eid.shape)
        if tuple(table.shape) != expected:
            raise ValueError(f"{name}: checkpoint tensor has shape {tuple(table.shape)}; the model expects {expected}.")
        experts = self.config.n_routed_experts
        if table.numel() and (int(table.min()) < 0 or int(table.max()) >= experts):
            raise ValueError(f"{name}: expert ids must lie in [0, {experts}).")
        router.tid2eid.copy_(table)
