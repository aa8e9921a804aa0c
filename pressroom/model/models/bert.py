"""The BERT encoder (sentence-transformers' MiniLM and kin): bidirectional attention, no KV cache, pooling only.

A step's prompts arrive whole and flattened, as every step's tokens do; the linear layers run on the flat
tokens (no padding), and only attention pads them into [sequences, longest, heads, dim] for SDPA with a
key mask. The sequence boundaries come from the step's attention metadata (`query_start_loc`).
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pressroom.attention.backend import get_attention_metadata
from pressroom.distributed.parallel_state import get_tp_size
from pressroom.model.layers.linear import ColumnParallelLinear, QKVParallelLinear
from pressroom.model.weights import expected_names, load_named_weights

# Checkpoint tensors no embedding needs: the NSP pooler head, MLM heads, a buffer of position ids.
_SKIPPED_PREFIXES = ("pooler.", "cls.")
_QKV_PARTS = {"attention.self.query.": "q", "attention.self.key.": "k", "attention.self.value.": "v"}
# HF's names of a layer's other modules -> ours (attention's output first: "output.dense." ends its name too)
_RENAMED = (("attention.output.dense.", "attn_out."), ("attention.output.LayerNorm.", "attn_norm."),
            ("intermediate.dense.", "up."), ("output.dense.", "down."), ("output.LayerNorm.", "out_norm."))


class _LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class PaddedGroup:
    """Sequences of similar length, contiguous in the (sorted) flat batch, as one [sequences, longest] grid for
    attention. The grid's buffer is zeroed once per forward and shared by the layers: they write only the real
    cells, so the padding stays zero (finite keys and values under the mask)."""
    __slots__ = ("start", "end", "num_seqs", "longest", "dest", "key_mask", "_grid", "_additive")

    def __init__(self, start: int, lengths: list[int], device: torch.device) -> None:
        self.start, self.end = start, start + sum(lengths)
        self.num_seqs, self.longest = len(lengths), max(lengths)
        self.dest = self.key_mask = self._grid = self._additive = None
        if min(lengths) != self.longest:  # equal lengths: the tokens already are the grid
            lens = np.array(lengths)
            owner = np.repeat(np.arange(len(lengths)), lens)
            offset = np.arange(self.end - start) - np.repeat(np.cumsum(lens) - lens, lens)
            self.dest = torch.from_numpy(owner * self.longest + offset).to(device)
            mask = np.arange(self.longest) < lens[:, None]
            self.key_mask = torch.from_numpy(mask).to(device)[:, None, None, :]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """The group's rows of the flat [tokens, width] -> [sequences, longest, width]"""
        x = x[self.start:self.end]
        if self.dest is None:
            return x.view(self.num_seqs, self.longest, x.shape[1])
        if self._grid is None or self._grid.shape[1] != x.shape[1] or self._grid.dtype != x.dtype:
            self._grid = x.new_zeros(self.num_seqs * self.longest, x.shape[1])
        self._grid.index_copy_(0, self.dest, x)
        return self._grid.view(self.num_seqs, self.longest, x.shape[1])

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The key mask as 0 / -inf to add to the scores: torch's CPU SDPA ran 20% faster with it than with a
        boolean mask (24 x 86-token sequences)."""
        if self.key_mask is not None and (self._additive is None or self._additive.dtype != dtype):
            zeros = torch.zeros(self.key_mask.shape, dtype=dtype, device=self.key_mask.device)
            self._additive = zeros.masked_fill(~self.key_mask, float("-inf"))
        return self._additive

    def unpad(self, grid: torch.Tensor) -> torch.Tensor:
        flat = grid.reshape(self.num_seqs * self.longest, *grid.shape[2:])
        return flat if self.dest is None else flat.index_select(0, self.dest)


class PaddedBatch:
    """A step's sequences sorted by length and cut into groups whose grids waste little on padding: attention's
    cost grows with a grid's sequences x longest^2, and one grid for a step of 8 to 130-token texts was mostly
    padding. Only attention sees the order: the layers' token-wise work runs on the sorted flat batch, and
    `perm` puts the tokens back in the step's order at the end."""
    __slots__ = ("groups", "perm")
    MAX_WASTE = 1.25  # a group's grid cells over its real tokens
    MIN_GROUP = 8  # sequences: fewer, larger SDPA calls

    def __init__(self, query_start_loc: list[int], device: torch.device) -> None:
        loc = np.asarray(query_start_loc)
        lengths = np.diff(loc)
        order = np.argsort(lengths, kind="stable")
        self.perm = None
        if np.any(order[1:] < order[:-1]):
            perm = np.concatenate([np.arange(loc[i], loc[i + 1]) for i in order])
            self.perm = torch.from_numpy(perm).to(device)
        self.groups = self._cut(lengths[order].tolist(), device)

    def _cut(self, lengths: list[int], device: torch.device) -> list[PaddedGroup]:
        groups, first, start, tokens = [], 0, 0, 0
        for i, n in enumerate(lengths):
            wasteful = (i - first + 1) * n > self.MAX_WASTE * (tokens + n)
            if wasteful and i - first >= self.MIN_GROUP:
                groups.append(PaddedGroup(start, lengths[first:i], device))
                first, start, tokens = i, start + tokens, 0
            tokens += n
        groups.append(PaddedGroup(start, lengths[first:], device))
        return groups

    def sort(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.perm is None else x.index_select(0, self.perm)

    def unsort(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.perm is None else torch.empty_like(x).index_copy_(0, self.perm, x)


class BertLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        if get_tp_size() > 1:
            raise ValueError("BERT models do not run with tensor parallelism; use tensor_parallel_size=1.")
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads, self.head_dim = heads, hidden // heads
        eps = config.layer_norm_eps
        self.qkv = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=True)
        # Column-parallel everywhere: one rank, and oneDNN then adds each bias inside the matmul.
        self.attn_out = ColumnParallelLinear(hidden, hidden, bias=True)
        self.attn_norm = _LayerNorm(hidden, eps)
        self.up = ColumnParallelLinear(hidden, config.intermediate_size, bias=True)
        self.down = ColumnParallelLinear(config.intermediate_size, hidden, bias=True)
        self.out_norm = _LayerNorm(hidden, eps)

    def forward(self, x: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
        qkv = self.qkv(x)
        attn = torch.cat([self._attend(qkv, group) for group in batch.groups]) if len(batch.groups) > 1 \
            else self._attend(qkv, batch.groups[0])
        x = self.attn_norm(x + self.attn_out(attn.reshape(x.shape)))
        return self.out_norm(x + self.down(F.gelu(self.up(x))))

    def _attend(self, qkv: torch.Tensor, group: PaddedGroup) -> torch.Tensor:
        shape = (group.num_seqs, group.longest, self.num_heads, self.head_dim)
        grid = group.pad(qkv)
        # On the CPU, torch's bf16 SDPA ran slower than its fp32 one (1.49 s against 1.18 s of a 1,024-text
        # MiniLM run): attention there computes in fp32, the matmuls around it stay in bf16.
        if grid.dtype == torch.bfloat16 and grid.device.type == "cpu":
            grid = grid.float()
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in grid.chunk(3, dim=-1))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=group.additive_mask(q.dtype))
        return group.unpad(attn.transpose(1, 2)).to(qkv.dtype)


class BertModel(nn.Module):
    """Hidden states of the last layer, one row per token; pooling is the runner's (worker/pooler.py)."""
    cuda_graphs_supported = False  # its attention pads by host-side lengths
    encoder_only = True

    def __init__(self, config) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"BERT with position_embedding_type={config.position_embedding_type!r} is not "
                             "supported; only absolute position embeddings are.")
        if getattr(config, "hidden_act", "gelu") != "gelu":
            raise ValueError(f"BERT with hidden_act={config.hidden_act!r} is not supported; only gelu is.")
        self.config = config
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        for emb in (self.word_embeddings, self.position_embeddings, self.token_type_embeddings):
            emb.weight.requires_grad_(False)
        self.embed_norm = _LayerNorm(hidden, config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        batch = PaddedBatch(get_attention_metadata().query_start_loc, input_ids.device)
        # Every token is segment 0 (a single text), so the token-type embedding is one row added to all.
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        x = batch.sort(self.embed_norm(x))
        for layer in self.layers:
            x = layer(x, batch)
        return batch.unsort(x)

    # ---- the name map (model/weights.py): HF's names, with or without `bert.` ----

    def skips(self, name: str) -> bool:
        name = name.removeprefix("bert.")
        return name.startswith(_SKIPPED_PREFIXES) or name.endswith("position_ids")

    def checkpoint_target(self, name: str) -> tuple[str, str | None]:
        name = name.removeprefix("bert.")
        if name.startswith("embeddings."):
            return name.removeprefix("embeddings.").replace("LayerNorm", "embed_norm"), None
        name = name.replace("encoder.layer.", "layers.")
        for part, shard in _QKV_PARTS.items():
            if part in name:
                return name.replace(part, "qkv."), shard
        for theirs, ours in _RENAMED:
            if f".{theirs}" in name:
                return name.replace(f".{theirs}", f".{ours}"), None
        return name, None

    def checkpoint_parts(self, name: str) -> list[str]:
        if not name.startswith("layers."):
            return ["embeddings." + name.replace("embed_norm", "LayerNorm")]
        name = name.replace("layers.", "encoder.layer.", 1)
        if ".qkv." in name:
            return [name.replace("qkv.", part) for part in _QKV_PARTS]
        for theirs, ours in _RENAMED:
            if f".{ours}" in name:
                return [name.replace(f".{ours}", f".{theirs}")]
        return [name]

    def expected_weights(self) -> set[str]:
        return expected_names(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads HF BERT tensors; returns the checkpoint names used, without `bert.`."""
        return load_named_weights(self, ((name.removeprefix("bert."), t) for name, t in weights))
