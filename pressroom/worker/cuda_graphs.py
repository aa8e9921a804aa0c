"""CUDA graphs for decode steps: one captured forward pass per padded batch size.

A decode step of n requests copies its inputs into static buffers, pads to the smallest captured
size >= n (padding rows write no KV, since slot -1 is skipped, and attend to nothing, since their
context length is 0) and replays the graph. Every size shares one memory pool, captured largest first.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from pressroom.attention.backend import AttentionMetadata, forward_context

logger = logging.getLogger("pressroom")


class CudaGraphs:
    def __init__(self, model: nn.Module, sizes: list[int], max_blocks_per_seq: int,
                 num_kv_splits: Callable[[int], int], device: str) -> None:
        self.model, self.sizes, self.num_kv_splits = model, sorted(sizes), num_kv_splits
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token per request
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def fits(self, num_decodes: int) -> bool:
        return num_decodes <= self.sizes[-1]

    def padded_size(self, num_decodes: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_decodes)]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_decodes=size, num_decode_tokens=size, slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size], seq_lens=self.seq_lens[:size],
            query_start_loc=[], seq_lens_host=[],
            query_start_loc_device=self.query_start_loc[:size + 1], max_query_len=1,
            num_kv_splits=self.num_kv_splits(size))

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            meta = self._meta(size)
            with forward_context(meta):
                self.model(self.input_ids[:size], self.positions[:size])  # compiles kernels outside capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self.model(self.input_ids[:size], self.positions[:size])
            self.graphs[size] = graph
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info("captured CUDA graphs for %d decode batch sizes (1..%d) in %.1fs, %.2f GiB",
                    len(self.sizes), self.sizes[-1], time.perf_counter() - start, used / (1 << 30))

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a decode-only step of n <= max size requests, from the captured graph."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:size].fill_(0)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.graphs[size].replay()
        return self.outputs[size][:n]
