"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from pressroom.kernels import batch_invariant as invariant
from pressroom.kernels import cpu
from pressroom.model.layers.linear import onednn_prepack
from pressroom.model.layers.quant import Q8Blocks, Q8Weight
from pressroom.model.lazy_weight import materialize


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.q8: Q8Blocks | None = None

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """This rank's rows of the vocabulary (narrowed before they are read, if `loaded` is lazy)."""
        if len(loaded.shape) != 2 or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding has shape {tuple(loaded.shape)}; the model expects "
                             f"({self.vocab_size}, {param.shape[1]}).")
        start = min(self.vocab_start, loaded.shape[0])
        shard = materialize(loaded.narrow(0, start, min(self.shard_size, loaded.shape[0] - start)))
        if isinstance(shard, Q8Weight):
            # The 8-bit form serves the LM head (llama.cpp's arithmetic, every step): this rank's rows of it,
            # padded to the shard's size as the dense weight is (each vocabulary row is computed as one rank would).
            self.q8 = Q8Blocks.pack(self._pad_q8(shard)) if cpu.available() else None
            shard = shard.dequantize()
        param.data[:shard.shape[0]].copy_(shard)

    def _pad_q8(self, shard: Q8Weight) -> Q8Weight:
        pad = self.shard_size - shard.q.shape[0]
        if pad == 0:
            return shard
        return Q8Weight(F.pad(shard.q, (0, 0, 0, pad)).contiguous(), F.pad(shard.scale, (0, 0, 0, pad)).contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        return tp_all_reduce(y.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    onednn: torch.Tensor | None = None
    batch_invariant = False  # set at load under --batch-invariant (model/batch_invariant.py)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """After loading: share the embedding's weight, and its 8-bit form if it came in one."""
        self.weight, self.q8 = embedding.weight, embedding.q8

    def prepack_onednn(self) -> None:
        """A oneDNN-blocked copy for the CPU matmul (the embedding may share the plain weight)."""
        if onednn_prepack(self.weight):
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, 32)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:  # one path for any number of rows (the mode refuses tensor parallelism)
            return invariant.linear(hidden, self.weight, None, self.onednn)[..., :self.vocab_size]
        if self.q8 is not None:  # fp32 logits, as the kernel gives them (the sampler reads fp32: no round trip)
            logits = self.q8.matmul(hidden.float())
        elif self.onednn is not None:
            logits = torch.ops.mkldnn._linear_pointwise(hidden, self.onednn, None, "none", [], "")
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = tp_all_gather(logits)
        return logits[..., :self.vocab_size]
