"""`pressroom train-drafter`: distil a DFlash2 drafter from the target's own greedy generations.

1. pressroom generates greedy continuations of the prompts (greedy, so the drafter learns exactly
   what greedy verification will accept), then prefills each whole sequence once with a recording
   proposer, which keeps the target features of every position as the runner hands them over.
2. Examples: at position p the context is the features of positions <= p (the last C), the anchor is
   token p + 1 (a generated one, as when serving) and the labels are tokens p + 2 .. p + K + 1. The
   drafter's slots go through the target's frozen LM head; the loss is cross-entropy per slot,
   weighted towards the first slots (a draft is only worth its prefix).
3. The selector's transition scorer then learns, with the drafter frozen, the likelihood of the true
   path through each block's top-M candidates (a linear-chain CRF up to the first slot whose true
   token is not a candidate).
4. Held-out sequences give the acceptance report: the mean acceptance length greedy verification
   would see (1 + the drafted prefix that matches the target's continuation), per-slot argmax and
   through the selector.
Everything runs on the target's device: on a GPU the corpus stays there and a batch is a gather.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pressroom.spec_decode.dflash2 import DFlash2Config, DFlash2Drafter, DFlash2Proposer
from pressroom.spec_decode.selector import lattice, viterbi_batch
from pressroom.worker.proposer import Draft, DraftRequest, Proposer

logger = logging.getLogger("pressroom")

SLOT_WEIGHT_DECAY = 0.8  # slot j's loss weight is 0.8^j: a late slot pays off only after every earlier one


class _Recorder(Proposer):
    """A proposer that drafts nothing and keeps every computed position's target features."""

    def __init__(self, layers: tuple[int, ...], keep_on_device: bool) -> None:
        self.layers, self.keep_on_device = layers, keep_on_device
        self.features: dict[str, list[torch.Tensor]] = {}

    def aux_layers(self) -> tuple[int, ...]:
        return self.layers

    def observe_features(self, req_id: str, rows: torch.Tensor) -> None:
        rows = rows.detach().clone() if self.keep_on_device else rows.detach().float().cpu()
        self.features.setdefault(req_id, []).append(rows)

    def forget(self, req_ids: Iterable[str]) -> None:
        pass  # kept for training

    def propose(self, requests: list[DraftRequest]) -> dict[str, Draft]:
        return {}


@dataclass(slots=True)
class Sequence:
    tokens: list[int]  # prompt + generated
    features: torch.Tensor  # [len(tokens), layers * width]: position p's features predict token p + 1
    prompt_len: int


def generate(llm, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False) -> list[list[int]]:
    """The target's greedy continuation of each prompt, prompt included."""
    from pressroom import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


def record(llm, prompts: list[list[int]], max_tokens: int, layers: tuple[int, ...], batch: int = 256,
           ignore_eos: bool = False, cache_dir: str | None = None, tag: str = "train",
           deadline: float | None = None) -> list[Sequence]:
    """Greedy continuations of `prompts` and the target features along them. The engine must compute
    every position: prefix caching off, and no preemption while recording (a KV cache for `batch`).
    `cache_dir`: each batch's continuations are kept there (`{tag}-NNNNN.pt`, token ids only: features
    are one prefill away) and reused by a later call, which resumes a recording that `deadline` paused."""
    if llm.engine.config.cache.enable_prefix_caching:
        raise ValueError("Recording needs every position computed: build the LLM with enable_prefix_caching=False.")
    if llm.engine.config.scheduler.async_scheduling:
        raise ValueError("Recording reads features on the synchronous path: build the LLM with async_scheduling=False.")
    longest = llm.engine.max_model_len - 1  # each sequence is prefilled again, and must leave room for a token
    seqs = []
    for n, i in enumerate(range(0, len(prompts), batch)):
        chunk = prompts[i:i + batch]
        shard = Path(cache_dir) / f"{tag}-{n:05d}.pt" if cache_dir else None
        full = _cached_continuations(shard, chunk)
        if full is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise TrainingPaused(f"paused recording {tag} continuations at prompt {i} of {len(prompts)}")
            full = [t[:longest] for t in generate(llm, chunk, max_tokens, ignore_eos)]
            if shard is not None:
                _save_continuations(shard, chunk, full)
        rows = _prefill_features(llm, full, layers)
        seqs += [Sequence(t, r, len(p)) for t, r, p in zip(full, rows, chunk)]
    return seqs


def _cached_continuations(shard: Path | None, prompts: list[list[int]]) -> list[list[int]] | None:
    """A shard's continuations, if it holds these very prompts (else it is recorded again)."""
    if shard is None or not shard.exists():
        return None
    saved = torch.load(shard, weights_only=True)
    if saved["prompts"] != prompts:
        return None
    return saved["sequences"]


def _save_continuations(shard: Path, prompts: list[list[int]], sequences: list[list[int]]) -> None:
    shard.parent.mkdir(parents=True, exist_ok=True)
    tmp = shard.with_suffix(".tmp")
    torch.save({"prompts": prompts, "sequences": sequences}, tmp)
    os.replace(tmp, shard)


def _prefill_features(llm, sequences: list[list[int]], layers: tuple[int, ...]) -> list[torch.Tensor]:
    from pressroom import SamplingParams
    runner = llm.engine.runner
    recorder = _Recorder(layers, keep_on_device=runner.device == "cuda")
    previous = runner.proposer
    runner.set_proposer(recorder)
    try:
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
        llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    finally:
        runner.set_proposer(previous)
    # Internal request ids count up in submission order, which is also the order of the outputs.
    rows = [torch.cat(recorder.features[k]) for k in sorted(recorder.features, key=int)]
    for tokens, r in zip(sequences, rows, strict=True):
        if len(r) != len(tokens):
            raise RuntimeError(f"recorded {len(r)} positions for {len(tokens)} tokens (a request was preempted: "
                               "record fewer prompts at a time or give the KV cache more room).")
    return rows


@dataclass(slots=True)
class Corpus:
    """Sequences laid end to end, so a batch of examples is a gather (on the training device)."""
    tokens: torch.Tensor  # [T]
    features: torch.Tensor  # [T, F]
    seq_start: torch.Tensor  # [T] first row of the sequence each row belongs to
    seq_end: torch.Tensor  # [T] one past its last row
    anchors_at: torch.Tensor  # [E] row p of each example (context ends at p, anchor p + 1)

    @classmethod
    def build(cls, seqs: list[Sequence], device: torch.device | str) -> Corpus:
        tokens, starts, ends, positions = [], [], [], []
        offset = 0
        for s in seqs:
            n = len(s.tokens)
            tokens.append(torch.tensor(s.tokens))
            starts.append(torch.full((n,), offset))
            ends.append(torch.full((n,), offset + n))
            # Serving drafts after the first generated token, so the anchor is a generated one; at
            # least one label must follow it.
            positions.append(torch.arange(offset + s.prompt_len - 1, offset + n - 2))
            offset += n
        return cls(torch.cat(tokens).to(device), torch.cat([s.features for s in seqs]).to(device),
                   torch.cat(starts).to(device), torch.cat(ends).to(device), torch.cat(positions).to(device))

    def batch(self, rows: torch.Tensor, k: int, context: int):
        """Features [b, C, F] (right-aligned, zero padding), mask [b, C], anchors [b], labels [b, K]
        (-100 past the end of a sequence)."""
        window = rows[:, None] + torch.arange(1 - context, 1, device=rows.device)
        mask = window >= self.seq_start[rows][:, None]
        feats = self.features[window.clamp(min=0)].float() * mask[..., None]
        label_at = rows[:, None] + torch.arange(2, k + 2, device=rows.device)
        inside = label_at < self.seq_end[rows][:, None]
        labels = torch.where(inside, self.tokens[label_at.clamp(max=len(self.tokens) - 1)], -100)
        return feats, mask, self.tokens[rows + 1], labels


def slot_logits(drafter: DFlash2Drafter, target, feats, masks, anchors) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots' hidden states [b, K, w] and their logits [b, K, vocab] through the target's frozen
    embedding and LM head."""
    with torch.no_grad():
        anchor = target.model.embed_tokens(anchors).float()
    slots = drafter(feats, masks, anchor)
    return slots, F.linear(slots.to(target.lm_head.weight.dtype), target.lm_head.weight).float()


def weighted_slot_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    k = labels.shape[1]
    weights = SLOT_WEIGHT_DECAY ** torch.arange(k, device=labels.device, dtype=torch.float32)
    per_slot = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                               reduction="none").view(labels.shape)
    valid = (labels != -100).float()
    return (per_slot * valid * weights).sum() / (valid * weights).sum().clamp(min=1.0)


# ---- the selector's scorer on a batch of blocks ----

def crf_loss(unary: torch.Tensor, edges: torch.Tensor, cand: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of the true path's prefix among all paths of that length, up to the first
    slot whose true token is not a candidate (blocks whose first slot misses are left out)."""
    hit = cand == labels[..., None]  # [b, K, M]
    length = hit.any(-1).int().cumprod(dim=1).sum(dim=1)  # true prefix inside the lattice
    keep = length > 0
    unary, edges, hit, length = unary[keep], edges[keep], hit[keep], length[keep]
    if not len(length):  # nothing to learn from this batch: a zero that still reaches the scorer
        return edges.sum() * 0
    true = hit.float().argmax(-1)  # [b, K] index of the true token (valid up to length)
    score = unary[:, 0].gather(1, true[:, :1])[:, 0] + edges[:, 0, 0].gather(1, true[:, :1])[:, 0]
    alpha = unary[:, 0] + edges[:, 0, 0]
    scores, log_z = [score], [torch.logsumexp(alpha, dim=-1)]
    for j in range(1, unary.shape[1]):
        prev, cur = true[:, j - 1], true[:, j]
        step = edges[:, j].gather(1, prev[:, None, None].expand(-1, 1, edges.shape[-1]))[:, 0]
        scores.append(scores[-1] + unary[:, j].gather(1, cur[:, None])[:, 0] + step.gather(1, cur[:, None])[:, 0])
        alpha = torch.logsumexp(alpha[:, :, None] + edges[:, j] + unary[:, j, None, :], dim=1)
        log_z.append(torch.logsumexp(alpha, dim=-1))
    at = (length - 1)[:, None]
    return (torch.stack(log_z, 1).gather(1, at) - torch.stack(scores, 1).gather(1, at)).mean()


# ---- evaluation ----

@torch.no_grad()
def acceptance_lengths(drafter: DFlash2Drafter, target, corpus: Corpus, rows: torch.Tensor, k: int, context: int,
                       chunk: int = 512) -> dict[str, float]:
    """Mean acceptance length greedy verification would see, drafting each slot's argmax and through
    the selector's best path."""
    if not len(rows):
        return {"argmax": 1.0, "selector": 1.0}
    matched = {"argmax": 0.0, "selector": 0.0}
    for i in range(0, len(rows), chunk):
        feats, masks, anchors, labels = corpus.batch(rows[i:i + chunk], k, context)
        slots, logits = slot_logits(drafter, target, feats, masks, anchors)
        cand, unary, edges = lattice(drafter.scorer, drafter.cfg.top_m, slots.float(), logits, anchors)
        selected = cand.gather(2, viterbi_batch(unary, edges)[..., None])[..., 0]
        for name, drafted in (("argmax", logits.argmax(-1)), ("selector", selected)):
            matched[name] += float((drafted == labels).int().cumprod(dim=1).sum())
    return {name: 1.0 + v / len(rows) for name, v in matched.items()}


def _selector_loss(drafter: DFlash2Drafter, target, feats, masks, anchors, labels) -> torch.Tensor:
    """The selector's CRF loss on a batch, the drafter frozen."""
    with torch.no_grad():
        slots, logits = slot_logits(drafter, target, feats, masks, anchors)
    cand, unary, edges = lattice(drafter.scorer, drafter.cfg.top_m, slots.float(), logits, anchors)
    return crf_loss(unary.float(), edges.float(), cand, labels)


# ---- training ----

class TrainingPaused(Exception):
    """The time limit came before the last step: the state is checkpointed, the same call resumes it."""


@dataclass(slots=True)
class Schedule:
    """How long to train and when to stop or pause. `validation`: a fraction of the training sequences kept
    aside to stop early on (never the held-out report's); every `eval_every` steps their acceptance length
    is measured, the best weights kept, and the phase ends after `patience` measurements without a gain.
    `work_dir`: checkpoints every `checkpoint_every` steps and at `deadline` (time.monotonic()), so that the
    same call, run again, resumes (a device call has a time limit)."""
    steps: int
    scorer_steps: int
    batch_size: int = 32
    lr: float = 3e-3
    validation: float = 0.0
    eval_every: int = 0
    patience: int = 5
    work_dir: str | None = None
    checkpoint_every: int = 500
    deadline: float | None = None


@dataclass(slots=True)
class _Phase:
    """One optimisation phase's progress (the drafter's, then the selector's)."""
    name: str
    step: int = 0
    losses: list[float] = field(default_factory=list)
    best: float = -1.0
    best_step: int = 0
    stale_evals: int = 0
    stopped_early: bool = False


def split_corpora(seqs: list[Sequence], held_out: float | list[Sequence], validation: float,
                  gen: torch.Generator, device) -> tuple[Corpus, Corpus | None, Corpus]:
    """(training, validation or None, held-out) corpora: `held_out` a fraction of `seqs` kept aside, or separate
    sequences; `validation` a fraction of the rest, kept aside to stop early on."""
    order = torch.randperm(len(seqs), generator=gen).tolist()
    if isinstance(held_out, float):
        cut = max(1, int(len(seqs) * held_out))
        test_seqs, order = [seqs[i] for i in order[:cut]], order[cut:]
    else:
        test_seqs = held_out
    cut = int(len(order) * validation) if validation else 0
    val_seqs, train_seqs = [seqs[i] for i in order[:cut]], [seqs[i] for i in order[cut:]]
    train_c = Corpus.build(train_seqs, device)
    if not len(train_c.anchors_at):
        raise ValueError("Too few tokens to train on: generate longer or more continuations.")
    return train_c, Corpus.build(val_seqs, device) if val_seqs else None, Corpus.build(test_seqs, device)


def train(target_model, seqs: list[Sequence], cfg: DFlash2Config, steps: int, batch_size: int = 32,
          lr: float = 3e-3, held_out: float | list[Sequence] = 0.1, seed: int = 0, progress: bool = True,
          scorer_steps: int | None = None, schedule: Schedule | None = None) -> tuple[DFlash2Drafter, dict]:
    """Trains a drafter (fp32 weights; bf16 autocast on a GPU) on the recorded sequences; returns it
    and a report. `held_out`: a fraction of `seqs` kept aside, or separate held-out sequences. `schedule`
    (optional) adds early stopping on a validation split and resumable checkpoints."""
    schedule = schedule or Schedule(steps, steps // 4 if scorer_steps is None else scorer_steps, batch_size, lr)
    device = target_model.lm_head.weight.device
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    train_c, val_c, test_c = split_corpora(seqs, held_out, schedule.validation, gen, device)
    hf = target_model.config
    drafter = DFlash2Drafter(hf.hidden_size, cfg, hf.vocab_size).to(device)
    with torch.no_grad():  # a tenth of the target's final norm: random slots start near uniform logits
        drafter.norm.weight.copy_(0.1 * target_model.model.norm.weight.float())
    k, context = cfg.block_size, DFlash2Proposer.context_len
    seen = train_c.anchors_at[torch.randperm(len(train_c.anchors_at), generator=gen)[:512].to(device)]
    ckpt = _Checkpoint.open(schedule.work_dir, cfg, len(train_c.anchors_at))
    report = ckpt.report if ckpt.report else {
        "train_examples": len(train_c.anchors_at), "validation_examples": len(val_c.anchors_at) if val_c else 0,
        "held_out_examples": len(test_c.anchors_at), "steps": schedule.steps, "block_size": k,
        "held_out_before": acceptance_lengths(drafter, target_model, test_c, test_c.anchors_at, k, context),
        "train_before": acceptance_lengths(drafter, target_model, train_c, seen, k, context)}
    body = [p for n, p in drafter.named_parameters() if not n.startswith("scorer")]
    fit = _Fit(drafter, train_c, val_c, schedule, gen, progress, ckpt, report, k, context,
               lambda corpus, rows: acceptance_lengths(drafter, target_model, corpus, rows, k, context))
    first = fit.run(_Phase("drafter"), schedule.steps, body, lambda feats, masks, anchors, labels: weighted_slot_loss(
        slot_logits(drafter, target_model, feats, masks, anchors)[1], labels), "argmax")
    report.update(_phase_report("", first))
    if schedule.scorer_steps:
        crf = fit.run(_Phase("selector"), schedule.scorer_steps, list(drafter.scorer.parameters()),
                      lambda *batch: _selector_loss(drafter, target_model, *batch), "selector")
        report.update(_phase_report("scorer_", crf))
    report["train_after"] = acceptance_lengths(drafter, target_model, train_c, seen, k, context)
    report["held_out_after"] = acceptance_lengths(drafter, target_model, test_c, test_c.anchors_at, k, context)
    return drafter.cpu(), _rounded(report)


def _phase_report(prefix: str, phase: _Phase) -> dict:
    losses = phase.losses
    out = {f"{prefix}first_loss": losses[0] if losses else None,
           f"{prefix}last_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
           f"{prefix}steps_run": phase.step}
    if phase.best >= 0:
        out[f"{prefix}best_validation"] = phase.best
        out[f"{prefix}best_step"] = phase.best_step
        out[f"{prefix}stopped_early"] = phase.stopped_early
    return out


class _Checkpoint:
    """A training run's state in its work directory: the phase in progress (weights, optimizer, schedule,
    random state, progress) and the finished phases' weights. A checkpoint of another drafter configuration
    or corpus is refused."""

    def __init__(self, path: Path | None, key: dict, state: dict | None) -> None:
        self.path, self.key, self.state = path, key, state
        self.report = state["report"] if state else None

    @classmethod
    def open(cls, work_dir: str | None, cfg, examples: int, file: str = "train_state.pt") -> _Checkpoint:
        """`cfg`: the drafter's configuration (a dataclass): a checkpoint of another one is refused. `file`: one
        per drafter method, so that methods share a work directory's recording."""
        key = {"config": asdict(cfg), "train_examples": examples}
        if work_dir is None:
            return cls(None, key, None)
        path = Path(work_dir) / file
        state = torch.load(path, map_location="cpu", weights_only=False) if path.exists() else None
        if state is not None and state["key"] != key:
            raise ValueError(f"{path} is a checkpoint of another drafter configuration or corpus: "
                             "give another --work-dir or delete it.")
        return cls(path, key, state)

    def phase(self, name: str) -> dict | None:
        """The saved state of phase `name`, if it was saved (finished, or in progress)."""
        return (self.state or {}).get("phases", {}).get(name)

    def save(self, report: dict, name: str, phase_state: dict) -> None:
        if self.path is None:
            return
        state = self.state or {"key": self.key, "phases": {}}
        state["phases"][name] = phase_state
        state["report"] = report
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.path)  # a call cut short leaves the last whole checkpoint
        self.state = state


BatchLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Score = Callable[[Corpus, torch.Tensor], dict[str, float]]  # (corpus, anchor rows) -> acceptance lengths


class _Fit:
    """AdamW with warm-up and cosine decay over one phase's parameters; with a validation corpus, the best
    weights by validation acceptance length are kept and the phase stops once it stops improving. Drafter-
    agnostic: a phase's loss of a batch (features, masks, anchors, labels) and the acceptance `score` are given."""

    def __init__(self, drafter: nn.Module, corpus: Corpus, val: Corpus | None, schedule: Schedule,
                 gen: torch.Generator, progress: bool, ckpt: _Checkpoint, report: dict, k: int, context: int,
                 score: Score) -> None:
        self.drafter, self.corpus, self.val = drafter, corpus, val
        self.schedule, self.gen, self.progress, self.ckpt, self.report = schedule, gen, progress, ckpt, report
        self.k, self.context, self.score = k, context, score
        self.val_rows = val.anchors_at[:4096] if val is not None else None  # the same rows every time

    def run(self, phase: _Phase, steps: int, params: list[torch.nn.Parameter], batch_loss: BatchLoss,
            metric: str) -> _Phase:
        """`metric`: the validation acceptance length early stopping follows (a key of `score`'s result)."""
        opt = torch.optim.AdamW(params, lr=self.schedule.lr, weight_decay=0.01)
        warmup = max(1, steps // 20)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
        best_weights = self._resume(phase, opt, sched)
        if phase.step >= steps or phase.stopped_early:
            return phase
        device = self.corpus.tokens.device
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
        every = self.schedule.eval_every if self.val is not None else 0
        bar = _bar(steps, self.progress, phase.name, phase.step)
        while phase.step < steps:
            pick = torch.randint(len(self.corpus.anchors_at), (self.schedule.batch_size,), generator=self.gen)
            batch = self.corpus.batch(self.corpus.anchors_at[pick.to(device)], self.k, self.context)
            with autocast:
                loss = batch_loss(*batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            phase.step += 1
            phase.losses.append(loss.item())
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{phase.losses[-1]:.3f}")
            if every and (phase.step % every == 0 or phase.step == steps):
                best_weights = self._validate(phase, metric, best_weights)
                if phase.stale_evals >= self.schedule.patience:
                    phase.stopped_early = True
                    break
            if self._checkpoint_due(phase):
                self._save(phase, opt, sched, best_weights)
                if self._past_deadline():
                    raise TrainingPaused(f"paused in the {phase.name} phase at step {phase.step} of {steps}")
        if bar is not None:
            bar.close()
        if best_weights is not None:  # the weights of the best validation, not the last step's
            self.drafter.load_state_dict(best_weights)
        self._save(phase, opt, sched, best_weights)
        return phase

    def _validate(self, phase: _Phase, metric: str, best_weights: dict | None) -> dict | None:
        score = self.score(self.val, self.val_rows)[metric]
        logger.info("train-drafter: %s step %d, validation acceptance length %.3f", phase.name, phase.step, score)
        if score > phase.best + 1e-4:
            phase.best, phase.best_step, phase.stale_evals = score, phase.step, 0
            return {n: t.detach().clone() for n, t in self.drafter.state_dict().items()}
        phase.stale_evals += 1
        return best_weights

    def _checkpoint_due(self, phase: _Phase) -> bool:
        if self.ckpt.path is None:
            return False
        return phase.step % self.schedule.checkpoint_every == 0 or self._past_deadline()

    def _past_deadline(self) -> bool:
        return self.schedule.deadline is not None and time.monotonic() >= self.schedule.deadline

    def _save(self, phase: _Phase, opt, sched, best_weights: dict | None) -> None:
        self.ckpt.save(self.report, phase.name, {
            "progress": asdict(phase), "drafter": _cpu(self.drafter.state_dict()), "optimizer": opt.state_dict(),
            "lr_schedule": sched.state_dict(), "generator": self.gen.get_state(),
            "best_weights": _cpu(best_weights) if best_weights is not None else None})

    def _resume(self, phase: _Phase, opt, sched) -> dict | None:
        saved = self.ckpt.phase(phase.name)
        if saved is None:
            return None
        for name, value in saved["progress"].items():
            setattr(phase, name, value)
        self.drafter.load_state_dict(saved["drafter"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["lr_schedule"])
        self.gen.set_state(saved["generator"])
        logger.info("train-drafter: resuming the %s phase at step %d", phase.name, phase.step)
        device = self.corpus.tokens.device
        best = saved["best_weights"]
        return {n: t.to(device) for n, t in best.items()} if best is not None else None


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for n, t in state.items()}


def _rounded(report: dict) -> dict:
    return {k: ({n: round(v, 3) for n, v in x.items()} if isinstance(x, dict) else
                round(x, 4) if isinstance(x, float) else x) for k, x in report.items()}


def _bar(total: int, on: bool, desc: str, done: int = 0):
    if not on:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=done, desc=f"train-drafter ({desc})", unit="step", mininterval=2.0)
