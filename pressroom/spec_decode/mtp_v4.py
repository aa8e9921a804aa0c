"""DeepSeek-V4's next-token-prediction layers (`mtp.{i}.*` in DeepSeek's checkpoints), for the MTP proposer.

V4 keeps hyper-connection streams ([hc_mult, hidden] per token) between its layers, so its MTP layer reads the
target's streams after the last decoder layer, not a final hidden state: with e the embedding of the next token
(zero at position 0), its input streams are h_proj(hnorm(stream)) + e_proj(enorm(e)) for each of the hc_mult
streams; one V4 decoder layer (sliding-window attention, a score-routed MoE) advances them; its own hyper-head
collapses them, then `norm` and the target's LM head give the draft. A further draft feeds the layer's own
output streams back in at the next position (as vLLM's DeepSeekV4MTP).
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pressroom.model.layers.norm import RMSNorm
from pressroom.model.models.deepseek import ReplicatedLinear
from pressroom.model.models.deepseek_v4 import SLIDING, DeepseekV4ForCausalLM, HyperHead, V4DecoderLayer, canonical_name
from pressroom.model.weights import expected_names, load_named_weights

# checkpoint names (after `mtp.{i}.`) of an MTP layer's own tensors -> its parameters
_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "e_proj.weight": "e_proj.weight",
        "h_proj.weight": "h_proj.weight", "norm.weight": "norm.weight", "hc_head_fn": "hc_head.hc_fn",
        "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
_SHARED = ("emb.tok_emb.", "embed.", "head.")  # copies of the target's (and their scales), never read
_MTP = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")


class V4NextTokenLayer(nn.Module):
    def __init__(self, config, ropes: dict[str, nn.Module]) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.e_proj, self.h_proj = ReplicatedLinear(hidden, hidden), ReplicatedLinear(hidden, hidden)
        # DeepSeek's compress ratio 0 for it; its window paged (the proposer keeps no recurrent state)
        self.layer = V4DecoderLayer(config, SLIDING, False, ropes, window_ring=False)
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(hidden, eps)


class V4MultiTokenPredictor(nn.Module):
    """The checkpoint's V4 MTP layers over the target's embedding, ropes and LM head (shared, not copied); the
    interface spec_decode/mtp.py's proposer drives (`active`, `previous_hidden`, `features`)."""

    cuda_graphs_supported = False  # previous_hidden is set from the host before each pass
    applies_sliding_window = True

    def __init__(self, target: DeepseekV4ForCausalLM) -> None:
        super().__init__()
        config = self.config = target.config
        self.hc_mult, self.hidden = config.hc_mult, config.hidden_size
        ropes = dict(target.model.ropes.items())
        self.mtp = nn.ModuleList(V4NextTokenLayer(config, ropes) for _ in range(config.num_nextn_predict_layers))
        self._target = (target,)  # a tuple: the target's modules are not this module's
        self.active = 0
        self.previous_hidden: torch.Tensor | None = None

    @property
    def target(self) -> DeepseekV4ForCausalLM:
        return self._target[0]

    def features(self, rows: torch.Tensor) -> torch.Tensor:
        """What the target hands over ([tokens, hc_mult * hidden] streams) as the layer reads it: as it is."""
        return rows

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The active layer's output streams, flattened ([tokens, hc_mult * hidden])."""
        mtp = self.mtp[self.active]
        embedded = self.target.model.embed_tokens(input_ids)
        embedded = embedded.masked_fill((positions == 0).unsqueeze(-1), 0.0)  # position 0 has no past
        previous = self.previous_hidden
        if previous is None:  # the cost profiles
            previous = embedded.new_zeros(embedded.shape[0], self.hc_mult * self.hidden)
        streams = previous.to(embedded.dtype).view(-1, self.hc_mult, self.hidden)
        streams = mtp.h_proj(mtp.hnorm(streams)) + mtp.e_proj(mtp.enorm(embedded)).unsqueeze(1)
        return mtp.layer(streams, positions, input_ids).flatten(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        mtp = self.mtp[self.active]
        return self.target.lm_head(mtp.norm(mtp.hc_head(hidden.view(-1, self.hc_mult, self.hidden))))

    # ---- weights: `mtp.{i}.X` loads X into mtp.{i} (its own tensors) or, named as the target names layer
    # L + i's, into mtp.{i}.layer ----

    def _layer_prefix(self, i: int) -> str:
        return f"model.layers.{self.config.num_hidden_layers + i}."

    def _checkpoint_names(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The MTP tensors under one naming: the own ones as `model.layers.{L + i}.X`, the decoder layer's in the
        target's canonical names for a layer L + i; the rest of the checkpoint left out."""
        for raw, tensor in weights:
            m = _MTP.match(raw)
            if m is None or m.group(2).startswith(_SHARED):
                continue
            i, rest = int(m.group(1)), m.group(2)
            if i >= len(self.mtp):
                raise ValueError(f"checkpoint tensor {raw!r}: the config has {len(self.mtp)} MTP layer(s) "
                                 "(num_nextn_predict_layers).")
            if rest in _OWN or rest.removesuffix("_scale_inv") in _OWN:  # e_proj / h_proj and their FP8 scales
                yield self._layer_prefix(i) + rest, tensor
            else:
                yield canonical_name(f"layers.{self.config.num_hidden_layers + i}.{rest}"), tensor

    def _split(self, name: str) -> tuple[int, str]:
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        return int(layer) - self.config.num_hidden_layers, rest

    def skips(self, name: str) -> bool:
        return False

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        i, rest = self._split(name)
        if rest in _OWN:
            return f"mtp.{i}.{_OWN[rest]}", None
        target, shard = self.target.checkpoint_target(name)
        return f"mtp.{i}.layer." + target.removeprefix(self._layer_prefix(i)), shard

    def checkpoint_parts(self, name: str) -> list[str]:
        _, i, part, rest = name.split(".", 3)
        if part != "layer":
            own = {v: k for k, v in _OWN.items()}[f"{part}.{rest}"]
            return [self._layer_prefix(int(i)) + own]
        return self.target.checkpoint_parts(self._layer_prefix(int(i)) + rest)

    checkpoint_pattern = "mtp.0.*"  # the first MTP layer's names in DeepSeek's checkpoints

    def mtp_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The checkpoint's MTP tensors (FP8 scales beside their weights) under the names this module loads."""
        return self._checkpoint_names(weights)

    def load_mtp_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """`weights` as `mtp_tensors` names them (dequantized, for an FP8 checkpoint); returns the names loaded,
        as `expected_weights` names them."""
        return load_named_weights(self, weights, self)

    def expected_weights(self) -> set[str]:
        return expected_names(self, self)
