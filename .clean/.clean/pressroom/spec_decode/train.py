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
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
           ignore_eos: bool = False) -> list[Sequence]:
    """Greedy continuations of `prompts` and the target features along them. The engine must compute
    every position: prefix caching off, and no preemption while recording (a KV cache for `batch`)."""
    if llm.engine.config.cache.enable_prefix_caching:
        raise ValueError("Recording needs every position computed: build the LLM with enable_prefix_caching=False.")
    if llm.engine.config.scheduler.async_scheduling:
        raise ValueError("Recording reads features on the synchronous path: build the LLM with async_scheduling=False.")
    longest = llm.engine.max_model_len - 1  # each sequence is prefilled again, and must leave room for a token
    seqs = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        full = [t[:longest] for t in generate(llm, chunk, max_tokens, ignore_eos)]
        rows = _prefill_features(llm, full, layers)
        seqs += [Sequence(t, r, len(p)) for t, r, p in zip(full, rows, chunk)]
    return seqs


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
    if not len(length):
        return unary.sum() * 0
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


# ---- training ----

def train(target_model, seqs: list[Sequence], cfg: DFlash2Config, steps: int, batch_size: int = 32,
          lr: float = 3e-3, held_out: float | list[Sequence] = 0.1, seed: int = 0, progress: bool = True,
          scorer_steps: int | None = None) -> tuple[DFlash2Drafter, dict]:
    """Trains a drafter (fp32 weights; bf16 autocast on a GPU) on the recorded sequences; returns it
    and a report. `held_out`: a fraction of `seqs` kept aside, or separate held-out sequences."""
    device = target_model.lm_head.weight.device
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if isinstance(held_out, float):
        order = torch.randperm(len(seqs), generator=gen).tolist()
        cut = max(1, int(len(seqs) * held_out))
        test_seqs, seqs = [seqs[i] for i in order[:cut]], [seqs[i] for i in order[cut:]]
    else:
        test_seqs = held_out
    train_c, test_c = Corpus.build(seqs, device), Corpus.build(test_seqs, device)
    if not len(train_c.anchors_at):
        raise ValueError("Too few tokens to train on: generate longer or more continuations.")
    hf = target_model.config
    drafter = DFlash2Drafter(hf.hidden_size, cfg, hf.vocab_size).to(device)
    with torch.no_grad():  # a tenth of the target's final norm: random slots start near uniform logits
        drafter.norm.weight.copy_(0.1 * target_model.model.norm.weight.float())
    k, context = cfg.block_size, DFlash2Proposer.context_len
    seen = train_c.anchors_at[torch.randperm(len(train_c.anchors_at), generator=gen)[:512].to(device)]
    report = {"train_examples": len(train_c.anchors_at), "held_out_examples": len(test_c.anchors_at),
              "steps": steps, "block_size": k}
    report["held_out_before"] = acceptance_lengths(drafter, target_model, test_c, test_c.anchors_at, k, context)
    report["train_before"] = acceptance_lengths(drafter, target_model, train_c, seen, k, context)
    losses = _fit(drafter, target_model, train_c, steps, batch_size, lr, gen, progress,
                  [p for n, p in drafter.named_parameters() if not n.startswith("scorer")], weighted_slot_loss)
    report["first_loss"], report["last_loss"] = losses[0], sum(losses[-10:]) / len(losses[-10:])
    scorer_steps = steps // 4 if scorer_steps is None else scorer_steps
    if scorer_steps:
        crf = _fit(drafter, target_model, train_c, scorer_steps, batch_size, lr, gen, progress,
                   list(drafter.scorer.parameters()), None)
        report["scorer_first_loss"], report["scorer_last_loss"] = crf[0], sum(crf[-10:]) / len(crf[-10:])
    report["train_after"] = acceptance_lengths(drafter, target_model, train_c, seen, k, context)
    report["held_out_after"] = acceptance_lengths(drafter, target_model, test_c, test_c.anchors_at, k, context)
    return drafter.cpu(), _rounded(report)


def _fit(drafter: DFlash2Drafter, target, corpus: Corpus, steps: int, batch_size: int, lr: float,
         gen: torch.Generator, progress: bool, params: list[torch.nn.Parameter], slot_loss) -> list[float]:
    """AdamW with warm-up and cosine decay. `slot_loss` None: the scorer's CRF loss (drafter frozen)."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    device = corpus.tokens.device
    k, context = drafter.cfg.block_size, DFlash2Proposer.context_len
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    losses, bar = [], _bar(steps, progress, "drafter" if slot_loss else "selector")
    for _ in range(steps):
        pick = torch.randint(len(corpus.anchors_at), (batch_size,), generator=gen).to(device)
        feats, masks, anchors, labels = corpus.batch(corpus.anchors_at[pick], k, context)
        with autocast:
            if slot_loss is not None:
                loss = slot_loss(slot_logits(drafter, target, feats, masks, anchors)[1], labels)
            else:
                with torch.no_grad():
                    slots, logits = slot_logits(drafter, target, feats, masks, anchors)
                cand, unary, edges = lattice(drafter.scorer, drafter.cfg.top_m, slots.float(), logits, anchors)
                loss = crf_loss(unary.float(), edges.float(), cand, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if bar is not None:
        bar.close()
    return losses


def _rounded(report: dict) -> dict:
    return {k: ({n: round(v, 3) for n, v in x.items()} if isinstance(x, dict) else
                round(x, 4) if isinstance(x, float) else x) for k, x in report.items()}


def _bar(total: int, on: bool, desc: str):
    if not on:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=f"train-drafter ({desc})", unit="step", mininterval=2.0)


def run_cli(args, engine_kwargs: dict) -> dict:
    """`pressroom train-drafter`: record, train, save the drafter and its report (report.json)."""
    import json
    import os

    from pressroom import LLM
    from pressroom.benchmarks.workload import read_prompt_texts
    from pressroom.spec_decode.dflash2 import save_drafter
    # The runner hands features over on the synchronous path; every position must be computed.
    llm = LLM(**{**engine_kwargs, "enable_prefix_caching": False, "async_scheduling": False})
    layers = _layers(args.target_layers, llm.engine.hf_config.num_hidden_layers)

    def recorded(path: str, limit: int | None) -> list[Sequence]:
        texts = read_prompt_texts(path)[:limit]
        if args.chat:
            prompts = [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        else:
            prompts = [llm.get_tokenizer().encode(t) for t in texts]
        return record(llm, prompts, args.max_tokens, layers, args.record_batch, args.ignore_eos)

    start = time.perf_counter()
    seqs = recorded(args.dataset_path, args.num_prompts)
    held_out = recorded(args.held_out_path, None) if args.held_out_path else 0.1
    logger.info("train-drafter: recorded %d sequences (%d tokens) in %.1f s", len(seqs),
                sum(len(s.tokens) for s in seqs), time.perf_counter() - start)
    cfg = DFlash2Config(block_size=args.draft_block_size, target_layers=layers, num_layers=args.num_layers,
                        num_heads=args.num_heads, rank=args.rank)
    drafter, report = train(llm.engine.model, seqs, cfg, args.steps, args.batch_size, args.lr, held_out,
                            scorer_steps=args.scorer_steps)
    save_drafter(drafter, args.output, dtype=getattr(torch, args.save_dtype))
    report["sequences"] = len(seqs)
    report["seconds"] = round(time.perf_counter() - start, 1)
    with open(os.path.join(args.output, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return report


def _layers(spec: str | None, num_layers: int) -> tuple[int, ...]:
    """Given layers ("1,15,28"), or three spread over the target's depth."""
    if spec:
        return tuple(int(x) for x in spec.split(","))
    return tuple(sorted({1, num_layers // 2, num_layers - 2}))
