"""Encoder CUDA graphs: a vision tower captured once per bucket of patch counts, replayed for a step's images.

A step's images (every request's that the step reaches, and not in the encoder cache) are packed in prompt order
into batches of at most the largest bucket's patches; each batch is padded to the smallest bucket that holds it
(the model's `encoder_graph_inputs`: padding patches attend to nothing real, and their rows come after the real
ones) and replays that bucket's graph. A batch the model cannot fit (more attention windows than the bucket's
fixed count) tries the next bucket; an image larger than the largest bucket, or a batch no bucket fits, runs
eagerly, all such at once. Not captured (`capture` never called: the CPU, or a test), the same padded inputs run
the same fixed-shape forward eagerly, so the padding is checked where there is no GPU.

The model provides: `media_patches(items)`, `encoder_graph_inputs(items, patches)` (None: does not fit),
`encoder_graph_example(patches)` (inputs for capture), `encoder_graph_forward(inputs)` (the captured body),
`split_media_rows(items, rows)` and `encode_media(items)` (the eager path); an audio tower also maps the configured
buckets to its own units (`encoder_graph_buckets`: whole 30-s windows, models/whisper_encoder.py).
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch
from torch import nn

from pressroom.multimodal.inputs import MediaItem

logger = logging.getLogger("pressroom")


def supports_encoder_graphs(model: nn.Module) -> bool:
    return callable(getattr(model, "encoder_graph_forward", None))


def pack_batches(patches: Sequence[int], largest: int) -> tuple[list[list[int]], list[int]]:
    """Item indices packed in order into batches of at most `largest` patches, and those larger than `largest`
    (eager)."""
    batches: list[list[int]] = []
    over: list[int] = []
    total = 0
    for i, n in enumerate(patches):
        if n > largest:
            over.append(i)
            continue
        if not batches or total + n > largest:
            batches.append([])
            total = 0
        batches[-1].append(i)
        total += n
    return batches, over


class EncoderGraphs:
    def __init__(self, model: nn.Module, buckets: Sequence[int]) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"Encoder graph buckets must be positive patch counts; got {list(buckets)}.")
        self.model = model
        to_units = getattr(model, "encoder_graph_buckets", None)  # an audio tower's: whole windows
        self.buckets = sorted(set(to_units(list(buckets)) if to_units else buckets))  # empty: none holds an item
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}  # captured buckets' static inputs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.padded_runs = 0  # batches run at a bucket's shape (replayed where captured)
        self.eager_items = 0  # items that fit no bucket

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket, largest first, in one memory pool."""
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            inputs = self.model.encoder_graph_example(bucket)
            self.model.encoder_graph_forward(inputs)  # picks and compiles kernels outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.model.encoder_graph_forward(inputs)
            self.inputs[bucket], self.graphs[bucket] = inputs, graph
        torch.cuda.synchronize()
        logger.info("captured %d encoder CUDA graphs (%s patches) in %.1fs, %.2f GiB", len(self.buckets),
                    ", ".join(map(str, self.buckets)), time.perf_counter() - start,
                    (free_before - torch.cuda.mem_get_info()[0]) / (1 << 30))

    @torch.inference_mode()
    def encode_media(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Each item's rows (as the model's `encode_media`), through the buckets where they fit."""
        rows: list[torch.Tensor | None] = [None] * len(items)
        batches, eager = pack_batches([self.model.media_patches([m]) for m in items], self.buckets[-1])
        for batch in batches:
            out = self._padded([items[i] for i in batch])
            if out is None:
                eager.extend(batch)
                continue
            for i, r in zip(batch, out):
                rows[i] = r
        if eager:
            eager.sort()
            self.eager_items += len(eager)
            for i, r in zip(eager, self.model.encode_media([items[i] for i in eager])):
                rows[i] = r
        return rows

    def _padded(self, items: list[MediaItem]) -> list[torch.Tensor] | None:
        """The items' rows from the smallest bucket that fits them (None: none does)."""
        start = bisect.bisect_left(self.buckets, self.model.media_patches(items))
        for bucket in self.buckets[start:]:
            inputs = self.model.encoder_graph_inputs(items, bucket)
            if inputs is None:
                continue
            self.padded_runs += 1
            if bucket not in self.graphs:
                return self.model.split_media_rows(items, self.model.encoder_graph_forward(inputs))
            for name, tensor in self.inputs[bucket].items():
                tensor.copy_(inputs[name])
            self.graphs[bucket].replay()
            # copies: the next replay overwrites the graph's output, the encoder cache keeps these rows
            return [rows.clone() for rows in self.model.split_media_rows(items, self.outputs[bucket])]
        return None
