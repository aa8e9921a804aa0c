"""`pressroom train-drafter --method dspark`: distil a DSpark drafter (spec_decode/dspark.py) from the target's own
greedy generations, on the corpus `training/drafter.py` records for DFlash2 (the same examples: the context is the
target features of positions <= p, the anchor is token p + 1, the labels tokens p + 2 .. p + K + 1).

A batch runs the drafter's block pass over each example's last `context` positions (right-aligned; only relative
positions matter to the rope), the block's logits through the target's frozen LM head, and the Markov head with
teacher forcing (each slot biased by the true token before it, as a verified prefix gives it when serving). Loss, as
DeepSpec trains DSpark: cross-entropy per slot weighted exp(-slot / gamma), plus the confidence head's binary
cross-entropy against the slot's acceptance. pressroom distils greedy verification, so the acceptance of a slot
given a correct prefix is whether its argmax is the target's token (DeepSpec uses 1 - the total variation to the
target's distribution, sampling's acceptance; greedy's is this indicator).

Saved in DeepSpec's layout (config.json with its keys beside the target's, model.safetensors under
Qwen3DSparkModel's names), without embed_tokens and lm_head: the proposer uses the target's own.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pressroom.spec_decode.dspark import CONFIG_FILE, SHARED_WITH_TARGET, WEIGHTS_FILE, DSparkConfig, DSparkDrafter
from pressroom.training.drafter import (
    Corpus,
    Schedule,
    Sequence,
    _Checkpoint,
    _Fit,
    _Phase,
    _phase_report,
    _rounded,
    split_corpora,
)

logger = logging.getLogger("pressroom")

LOSS_DECAY_GAMMA = 4.0  # slot i's cross-entropy weighs exp(-i / gamma) (DeepSpec's loss_decay_gamma)
CONFIDENCE_WEIGHT = 0.1  # the confidence head's loss beside the cross-entropy (DeepSpec's confidence_head_alpha)


@dataclass(frozen=True, slots=True)
class DSparkTrainConfig:
    """The drafter's shape (its width is the target's: DSpark's layers run at the target's hidden size)."""
    block_size: int
    target_layers: tuple[int, ...]
    num_layers: int = 2
    markov_rank: int = 32
    markov_head_type: str = "gated"
    mask_token_id: int | None = None  # None: the target's last vocabulary id
    context: int = 256  # target positions a training example attends to


def drafter_config(target_hf, cfg: DSparkTrainConfig) -> DSparkConfig:
    """The DSparkConfig of a new drafter for `target_hf` (the attention and MLP shapes are the target's)."""
    heads = target_hf.num_attention_heads
    mask = target_hf.vocab_size - 1 if cfg.mask_token_id is None else cfg.mask_token_id
    return DSparkConfig(
        hidden_size=target_hf.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(target_hf, "num_key_value_heads", heads) or heads,
        head_dim=getattr(target_hf, "head_dim", None) or target_hf.hidden_size // heads,
        intermediate_size=target_hf.intermediate_size, vocab_size=target_hf.vocab_size,
        rms_norm_eps=target_hf.rms_norm_eps, rope_theta=float(getattr(target_hf, "rope_theta", 10000.0)),
        attention_bias=False, hidden_act="silu", block_size=cfg.block_size, target_layer_ids=cfg.target_layers,
        num_target_layers=target_hf.num_hidden_layers, mask_token_id=mask, markov_rank=cfg.markov_rank,
        markov_head_type=cfg.markov_head_type if cfg.markov_rank else None, enable_confidence_head=True,
        confidence_head_with_markov=cfg.markov_rank > 0)


def new_drafter(target_model, cfg: DSparkTrainConfig) -> DSparkDrafter:
    """A drafter with the target's embeddings and LM head (frozen copies, as DeepSpec's) and small random rest."""
    drafter = DSparkDrafter(drafter_config(target_model.config, cfg))
    with torch.no_grad():  # through the embedding module: a GGUF target's table may be quantized
        ids = torch.arange(drafter.cfg.vocab_size, device=target_model.lm_head.weight.device)
        drafter.embed_tokens.weight.copy_(target_model.model.embed_tokens(ids).float().cpu())
        drafter.lm_head.weight.copy_(target_model.lm_head.weight.float().cpu())
        if drafter.markov_head is not None:  # the bias starts at zero: the backbone learns first
            drafter.markov_head.markov_w2.weight.zero_()
    for name in SHARED_WITH_TARGET:
        drafter.get_parameter(name).requires_grad_(False)
    return drafter


def block_outputs(drafter: DSparkDrafter, feats: torch.Tensor, masks: torch.Tensor, anchors: torch.Tensor,
                  prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [b, K, vocab] (Markov bias from `prev` [b, K], the token before each slot) and confidence logits
    [b, K] of a batch of examples (features [b, C, F] right-aligned, mask [b, C])."""
    b, context = masks.shape
    positions = torch.arange(context, device=feats.device).expand(b, context)
    ctx = drafter.context_kv(feats.to(drafter.fc.weight.dtype), positions)
    starts = torch.full((b,), context, device=feats.device)
    hidden = drafter.block_hidden(drafter.embed_tokens(anchors), drafter.embed_tokens.weight[drafter.cfg.mask_token_id],
                                  starts, ctx, masks)[:, :prev.shape[1]]
    logits = drafter.lm_head(hidden).float()
    features = hidden
    if drafter.markov_head is not None:
        state = drafter.markov_head.initial_state(hidden[:, 0])
        biases = []
        for i in range(prev.shape[1]):
            bias, state = drafter.markov_head.step(prev[:, i], hidden[:, i], state)
            biases.append(bias)
        logits = logits + torch.stack(biases, dim=1).float()
    if drafter.cfg.confidence_head_with_markov:
        features = torch.cat([hidden, drafter.markov_head.markov_w1(prev).to(hidden.dtype)], dim=-1)
    return logits, drafter.confidence_head(features).float()


def teacher_prev(anchors: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The token before each slot on the true path: the anchor, then the labels (padding: the anchor's id)."""
    prev = torch.cat([anchors[:, None], labels[:, :-1]], dim=1)
    return torch.where(prev < 0, anchors[:, None], prev)


def dspark_loss(drafter: DSparkDrafter, feats, masks, anchors, labels) -> torch.Tensor:
    logits, confidence = block_outputs(drafter, feats, masks, anchors, teacher_prev(anchors, labels))
    valid = (labels != -100).float()
    weights = torch.exp(-torch.arange(labels.shape[1], device=labels.device, dtype=torch.float32)
                        / LOSS_DECAY_GAMMA) * valid
    per_slot = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                               reduction="none").view(labels.shape)
    accepted = (logits.detach().argmax(-1) == labels).float()
    bce = F.binary_cross_entropy_with_logits(confidence, accepted, reduction="none")
    total = weights.sum().clamp(min=1.0)
    return (per_slot * weights).sum() / total + CONFIDENCE_WEIGHT * (bce * weights).sum() / total


@torch.no_grad()
def acceptance_lengths(drafter: DSparkDrafter, corpus: Corpus, rows: torch.Tensor, k: int, context: int,
                       chunk: int = 256) -> dict[str, float]:
    """Mean acceptance length greedy verification would see: each slot's argmax drawn left to right, the Markov
    head biased by the drafted token before it (as serving draws them); and the confidence head's mean absolute
    error against what survived."""
    if not len(rows):
        return {"argmax": 1.0, "confidence_error": 0.0}
    matched = error = 0.0
    for i in range(0, len(rows), chunk):
        feats, masks, anchors, labels = corpus.batch(rows[i:i + chunk], k, context)
        drafted, confidences = draft_greedy(drafter, feats, masks, anchors, labels.shape[1])
        survived = (drafted == labels).int().cumprod(dim=1)
        matched += float(survived.sum())
        prefix_ok = torch.cat([torch.ones_like(survived[:, :1]), survived[:, :-1]], dim=1).bool() & (labels != -100)
        error += float(((confidences - (drafted == labels).float()).abs() * prefix_ok).sum()
                       / prefix_ok.sum().clamp(min=1) * len(labels))
    return {"argmax": 1.0 + matched / len(rows), "confidence_error": error / len(rows)}


def draft_greedy(drafter: DSparkDrafter, feats, masks, anchors, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafted tokens [b, k] and their confidences [b, k], each slot's Markov bias from the drafted token
    before it."""
    drafted, confidences = [], []
    prev = anchors
    b, context = masks.shape
    positions = torch.arange(context, device=feats.device).expand(b, context)
    ctx = drafter.context_kv(feats.to(drafter.fc.weight.dtype), positions)
    hidden = drafter.block_hidden(drafter.embed_tokens(anchors), drafter.embed_tokens.weight[drafter.cfg.mask_token_id],
                                  torch.full((b,), context, device=feats.device), ctx, masks)
    state = drafter.markov_head.initial_state(hidden[:, 0]) if drafter.markov_head is not None else None
    for i in range(k):
        logits = drafter.lm_head(hidden[:, i]).float()
        if drafter.markov_head is not None:
            bias, state = drafter.markov_head.step(prev, hidden[:, i], state)
            logits = logits + bias.float()
        confidences.append(drafter.confidence(hidden[:, i], prev))
        prev = logits.argmax(-1)
        drafted.append(prev)
    return torch.stack(drafted, dim=1), torch.stack(confidences, dim=1)


def train(target_model, seqs: list[Sequence], cfg: DSparkTrainConfig, schedule: Schedule,
          held_out: float | list[Sequence] = 0.1, seed: int = 0, progress: bool = True
          ) -> tuple[DSparkDrafter, dict]:
    """Trains a DSpark drafter (fp32 weights; bf16 autocast on a GPU) on the recorded sequences; returns it and a
    report (acceptance lengths before and after, on the training and held-out examples)."""
    device = target_model.lm_head.weight.device
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    train_c, val_c, test_c = split_corpora(seqs, held_out, schedule.validation, gen, device)
    drafter = new_drafter(target_model, cfg).to(device)
    k, context = cfg.block_size, cfg.context

    def score(corpus: Corpus, rows: torch.Tensor) -> dict[str, float]:
        return acceptance_lengths(drafter, corpus, rows, k, context)

    seen = train_c.anchors_at[torch.randperm(len(train_c.anchors_at), generator=gen)[:512].to(device)]
    ckpt = _Checkpoint.open(schedule.work_dir, cfg, len(train_c.anchors_at), "dspark_state.pt")
    report = ckpt.report if ckpt.report else {
        "method": "dspark", "train_examples": len(train_c.anchors_at),
        "validation_examples": len(val_c.anchors_at) if val_c else 0, "held_out_examples": len(test_c.anchors_at),
        "steps": schedule.steps, "block_size": k, "held_out_before": score(test_c, test_c.anchors_at),
        "train_before": score(train_c, seen)}
    params = [p for p in drafter.parameters() if p.requires_grad]
    fit = _Fit(drafter, train_c, val_c, schedule, gen, progress, ckpt, report, k, context, score)
    phase = fit.run(_Phase("dspark"), schedule.steps, params, lambda *batch: dspark_loss(drafter, *batch), "argmax")
    report.update(_phase_report("", phase))
    report["train_after"] = score(train_c, seen)
    report["held_out_after"] = score(test_c, test_c.anchors_at)
    return drafter.cpu(), _rounded(report)


def save_drafter(drafter: DSparkDrafter, target_hf, path: str, dtype: torch.dtype = torch.float32) -> None:
    """DeepSpec's layout: the target's config.json plus the drafter's keys, and its tensors under their names
    (embed_tokens and lm_head left out: the proposer takes the target's)."""
    from safetensors.torch import save_file
    cfg = drafter.cfg
    os.makedirs(path, exist_ok=True)
    meta = target_hf.to_dict()
    meta.update(architectures=["Qwen3DSparkModel"], model_type="qwen3", num_target_layers=cfg.num_target_layers,
                num_hidden_layers=cfg.num_hidden_layers, num_key_value_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim, block_size=cfg.block_size, target_layer_ids=list(cfg.target_layer_ids),
                mask_token_id=cfg.mask_token_id, markov_rank=cfg.markov_rank,
                markov_head_type=cfg.markov_head_type, enable_confidence_head=cfg.enable_confidence_head,
                confidence_head_with_markov=cfg.confidence_head_with_markov, attention_bias=False,
                hidden_act="silu", layer_types=["full_attention"] * cfg.num_hidden_layers, tie_word_embeddings=False)
    # The rope it was trained with (plain, drafter_config's), not a target's YaRN the drafter never saw.
    meta.pop("rope_scaling", None)
    meta["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(meta, f, indent=2)
    tensors = {name: t.detach().to(dtype).contiguous() for name, t in drafter.state_dict().items()
               if name not in SHARED_WITH_TARGET}
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
