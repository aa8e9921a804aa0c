"""DFlash2's block drafter: K draft slots in one forward pass, conditioned on the target's own features.

Inputs: the residual stream of a few target layers at the last verified context positions (fused
into the drafter's width), and the anchor, the newest verified token (the target's embedding of it,
added to K learned slot embeddings). Each layer lets the block attend to the context and to itself
with no causal mask (every slot sees every other), then mixes neighbouring slots with a grouped
dynamic depthwise convolution,

    out[i, c] = sum_t (base[t, c] + delta[i, t, g(c)]) * x[i - t, c],   t < kernel,

whose per-slot weights `delta` are computed from the slot itself (one set per channel group g(c)).
The target's frozen LM head turns the slots into logits; `selector.py` picks the path through each
slot's top-M candidates (the selector's scorer is part of the drafter's checkpoint). The proposer
keeps, per request, the target features of its last verified positions (the runner hands them over
after every step) and drafts from them. `pressroom train-drafter` (training/drafter.py) distils one.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.config import SpeculativeConfig
from pressroom.spec_decode.selector import CandidateScorer, conditionals_batch, lattice, select_path, viterbi_batch
from pressroom.worker.device import synchronize
from pressroom.worker.model_runner import ModelRunner
from pressroom.worker.proposer import Draft, DraftRequest, Proposer

CONFIG_FILE, WEIGHTS_FILE = "dflash2.json", "model.safetensors"


@dataclass(slots=True)
class DFlash2Config:
    block_size: int = 8  # K: draft slots per forward pass
    target_layers: tuple[int, ...] = (1, 15, 28)  # whose residual stream is the context
    num_layers: int = 1
    num_heads: int = 8
    conv_kernel_size: int = 3
    conv_group_size: int = 64  # channels that share one dynamic weight
    top_m: int = 8  # selector candidates per slot
    rank: int = 32  # selector transition rank

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_layers < 1 or self.conv_kernel_size < 1 or not self.target_layers:
            raise ValueError("DFlash2Config needs block_size, num_layers, conv_kernel_size >= 1 and target layers.")


class GroupedDynamicConv(nn.Module):
    def __init__(self, width: int, kernel: int, group_size: int) -> None:
        super().__init__()
        if width % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide the width {width}.")
        self.kernel, self.group_size = kernel, group_size
        base = torch.zeros(kernel, width)
        base[0] = 1.0  # starts as the identity: the slot itself
        self.base = nn.Parameter(base)
        self.delta = nn.Linear(width, kernel * (width // group_size))
        nn.init.zeros_(self.delta.weight)
        nn.init.zeros_(self.delta.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, K, width] -> the same shape; slot i mixes slots i - kernel + 1 .. i."""
        b, k, width = x.shape
        delta = self.delta(x).view(b, k, self.kernel, width // self.group_size)
        weights = self.base + delta.repeat_interleave(self.group_size, dim=-1)  # [b, K, kernel, width]
        padded = F.pad(x, (0, 0, self.kernel - 1, 0))  # zeros before the first slot
        shifted = torch.stack([padded[:, self.kernel - 1 - t:self.kernel - 1 - t + k] for t in range(self.kernel)],
                              dim=2)  # [b, K, kernel, width]: shifted[:, i, t] = x[:, i - t]
        return (weights * shifted).sum(dim=2)


class BlockLayer(nn.Module):
    def __init__(self, width: int, cfg: DFlash2Config) -> None:
        super().__init__()
        self.heads = cfg.num_heads
        self.attn_norm = nn.RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.conv_norm = nn.RMSNorm(width)
        self.conv = GroupedDynamicConv(width, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_norm = nn.RMSNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.SiLU(), nn.Linear(2 * width, width))

    def forward(self, block: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor) -> torch.Tensor:
        """block: [b, K, w]; context: [b, C, w] with context_mask [b, C] (False: padding)."""
        b, k, w = block.shape
        h = self.attn_norm(torch.cat([context, block], dim=1))
        q, key, value = self.qkv(h).chunk(3, dim=-1)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, -1, self.heads, w // self.heads).transpose(1, 2)

        visible = torch.cat([context_mask, torch.ones(b, k, dtype=torch.bool, device=block.device)], dim=1)
        o = F.scaled_dot_product_attention(heads(q[:, -k:]), heads(key), heads(value),
                                           attn_mask=visible[:, None, None, :])  # no causal mask inside the block
        block = block + self.out(o.transpose(1, 2).reshape(b, k, w))
        block = block + self.conv(self.conv_norm(block))
        return block + self.mlp(self.mlp_norm(block))


class DFlash2Drafter(nn.Module):
    def __init__(self, width: int, cfg: DFlash2Config, vocab_size: int) -> None:
        super().__init__()
        self.cfg, self.width, self.vocab_size = cfg, width, vocab_size
        self.fuse = nn.Linear(len(cfg.target_layers) * width, width, bias=False)
        self.slots = nn.Parameter(torch.randn(cfg.block_size, width) * 0.02)
        self.layers = nn.ModuleList(BlockLayer(width, cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(width)
        self.scorer = CandidateScorer(vocab_size, width, cfg.rank)

    def forward(self, features: torch.Tensor, context_mask: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """features: [b, C, layers * w] target features of the last C verified positions (mask False for
        padding); anchor: [b, w] the target's embedding of the newest verified token. Returns [b, K, w],
        one hidden state per draft slot, for the target's LM head."""
        context = self.fuse(features)
        block = anchor[:, None, :] + self.slots
        for layer in self.layers:
            block = layer(block, context, context_mask)
        return self.norm(block)


def save_drafter(drafter: DFlash2Drafter, path: str, dtype: torch.dtype = torch.float32) -> None:
    """Config and weights (stored in `dtype`; bf16 halves a committed drafter) under `path`."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump({"width": drafter.width, "vocab_size": drafter.vocab_size, **asdict(drafter.cfg)}, f, indent=2)
    save_file({k: v.to(dtype).contiguous() for k, v in drafter.state_dict().items()}, os.path.join(path, WEIGHTS_FILE))


def load_drafter(path: str) -> DFlash2Drafter:
    from safetensors.torch import load_file
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path!r} is not a DFlash2 drafter ({CONFIG_FILE} unreadable: {e}).") from None
    width, vocab = meta.pop("width"), meta.pop("vocab_size")
    meta["target_layers"] = tuple(meta["target_layers"])
    drafter = DFlash2Drafter(width, DFlash2Config(**meta), vocab)
    drafter.load_state_dict(load_file(os.path.join(path, WEIGHTS_FILE)))
    return drafter


EMBEDDED_DRAFTER = os.path.join(os.path.dirname(__file__), "drafters", "smollm2-135m-instruct")
_EMBEDDED_TARGET_LAYERS = 30  # SmolLM2-135M's depth (with its width and vocabulary, how the target is told)


def _embedded_drafter(hf) -> str:
    """The committed drafter, distilled for the embedded SmolLM2-135M-Instruct (`pressroom train-drafter`)."""
    with open(os.path.join(EMBEDDED_DRAFTER, CONFIG_FILE)) as f:
        meta = json.load(f)
    if (hf.hidden_size, hf.vocab_size, hf.num_hidden_layers) != (meta["width"], meta["vocab_size"],
                                                                  _EMBEDDED_TARGET_LAYERS):
        raise ValueError('dflash2 without "model" uses the drafter committed for the embedded SmolLM2-135M-Instruct; '
                         "this target needs its own: distil one with `pressroom train-drafter` and pass "
                         '"model": its directory.')
    return EMBEDDED_DRAFTER


class DFlash2Proposer(Proposer):
    """Drafts a block per request from the target features of its last verified positions."""
    context_len = 16  # verified positions of target features kept per request

    def __init__(self, config: SpeculativeConfig, target: ModelRunner) -> None:
        hf = target.model.config
        path = config.model or _embedded_drafter(hf)
        self.drafter = load_drafter(path)
        if self.drafter.width != hf.hidden_size or self.drafter.vocab_size != hf.vocab_size:
            raise ValueError(f"The DFlash2 drafter at {path!r} was made for a target of width "
                             f"{self.drafter.width} and vocabulary {self.drafter.vocab_size}, not "
                             f"{hf.hidden_size} and {hf.vocab_size}.")
        if max(self.drafter.cfg.target_layers) >= hf.num_hidden_layers:
            raise ValueError("The DFlash2 drafter reads target layers the target does not have.")
        self.drafter.to(device=target.device, dtype=target.dtype).eval()
        self.target = target
        self.k = min(config.num_speculative_tokens, self.drafter.cfg.block_size)
        self.features: dict[str, torch.Tensor] = {}
        self.generator = torch.Generator(device=target.device).manual_seed(2)

    @torch.inference_mode()
    def profile_decode_steps(self, counts: list[int]) -> list[tuple[int, float]]:
        """Seconds of the target's LM head over that many draft slots, what one more draft position costs
        over that many requests (the block pass itself is shared by all positions): the budget then plans
        how many slots to score, and a request planned none is not drafted at all."""
        head = self.target.model.compute_logits
        return [(n, self._best_time(lambda n=n: head(self._zeros(n, self.drafter.width)))) for n in counts]

    @torch.inference_mode()
    def profile_block_passes(self, counts: list[int]) -> list[tuple[int, float]]:
        """Seconds of the drafter's block pass over that many requests (full context): paid once per
        drafting request, however many of its slots are scored."""
        width, c = self.drafter.width, self.context_len
        layers = len(self.drafter.cfg.target_layers)

        def block(n: int) -> None:
            mask = torch.ones(n, c, dtype=torch.bool, device=self.target.device)
            self.drafter(self._zeros(n, c, layers * width), mask, self._zeros(n, width))

        return [(n, self._best_time(lambda n=n: block(n))) for n in counts]

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.target.dtype, device=self.target.device)

    def _best_time(self, fn) -> float:
        best = float("inf")
        for _ in range(3):  # the first warms up
            synchronize(self.target.device)
            start = time.perf_counter()
            fn()
            synchronize(self.target.device)
            best = min(best, time.perf_counter() - start)
        return best

    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.drafter.cfg.target_layers)

    def observe_features(self, req_id: str, rows: torch.Tensor) -> None:
        old = self.features.get(req_id)
        rows = rows if old is None else torch.cat([old, rows])
        self.features[req_id] = rows[-self.context_len:]

    def forget(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self.features.pop(rid, None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> dict[str, Draft]:
        wanted = [r for r in requests if r.max_drafts > 0 and r.req_id in self.features]
        if not wanted:
            return {}
        feats, mask = self._context([self.features[r.req_id] for r in wanted])
        model = self.target.model
        anchors = torch.tensor([r.token_ids[-1] for r in wanted], device=feats.device)
        slots = self.drafter(feats, mask, model.model.embed_tokens(anchors))  # [B, K, width]
        # The LM head dominates the drafter's cost: only as many slots as some request may draft.
        slots = slots[:, :max(min(self.k, r.max_drafts) for r in wanted)]
        logits = model.compute_logits(slots.flatten(0, 1)).view(len(wanted), slots.shape[1], -1)
        drafts = self._greedy_paths(wanted, anchors, slots, logits)
        for b, r in enumerate(wanted):
            if not r.params.greedy:
                drafts[r.req_id] = self._sampled_path(r, int(anchors[b]), slots[b], logits[b])
        return drafts

    def _greedy_paths(self, wanted: list[DraftRequest], anchors: torch.Tensor, slots: torch.Tensor,
                      logits: torch.Tensor) -> dict[str, Draft]:
        """Every greedy request's best path at once, grouped by how many drafts it may take (a path over
        k slots is not the prefix of one over more)."""
        groups: dict[int, list[int]] = {}
        for b, r in enumerate(wanted):
            if r.params.greedy:
                groups.setdefault(min(self.k, r.max_drafts), []).append(b)
        if not groups:
            return {}
        cand, unary, edges = lattice(self.drafter.scorer, self.drafter.cfg.top_m, slots, logits, anchors)
        unary, edges = unary.float(), edges.float()
        drafts = {}
        for k, rows in groups.items():
            at = torch.tensor(rows, device=slots.device)
            u, e = unary[at, :k], edges[at, :k]
            path = viterbi_batch(u, e)
            tokens = cand[at, :k].gather(2, path[..., None])[..., 0].tolist()
            confidence = conditionals_batch(u, e, path).tolist()
            for i, b in enumerate(rows):
                drafts[wanted[b].req_id] = Draft(tokens[i], None, confidence[i])
        return drafts

    def _context(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max(len(r) for r in rows)
        feats = rows[0].new_zeros(len(rows), longest, rows[0].shape[1])
        mask = torch.zeros(len(rows), longest, dtype=torch.bool, device=feats.device)
        for i, r in enumerate(rows):  # right-aligned: the newest position last
            feats[i, longest - len(r):] = r
            mask[i, longest - len(r):] = True
        return feats, mask

    def _sampled_path(self, r: DraftRequest, anchor: int, slots: torch.Tensor, logits: torch.Tensor) -> Draft:
        """A path drawn from the chain at the request's temperature, with its q for lossless verification."""
        k = min(self.k, r.max_drafts)
        logits = logits.float()
        log_p = torch.log_softmax(logits[:k], dim=-1)
        unary, candidates = log_p.topk(self.drafter.cfg.top_m, dim=-1)
        edges = self.drafter.scorer.edges(anchor, candidates, slots[:k].to(self.drafter.slots.dtype))
        path = select_path(candidates, unary, [e.float() for e in edges], r.params.temperature, self.generator)
        return Draft(path.tokens, path.vocab_probs(candidates, logits.shape[-1]), path.confidence)
