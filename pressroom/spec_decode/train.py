"""`pressroom train-drafter`: distil a DFlash2 drafter from the target's own greedy generations.

1. pressroom generates continuations of the prompts (greedy, so the drafter learns exactly what
   greedy verification will accept); a recording proposer keeps the target features of every
   verified position, handed over by the runner as in serving.
2. Examples: at position p the context is the features of positions <= p (the last C), the anchor is
   token p + 1 (a generated one, as when serving) and the labels are tokens p + 2 .. p + K + 1. The
   drafter's slots go through the target's frozen LM head; the loss is cross-entropy per slot.
3. Held-out sequences give the acceptance report: the mean acceptance length greedy verification
   would see (1 + the drafted prefix that matches the target's continuation).
Training the selector's transition scorer on the true path is not done yet (it starts near zero, so
the selector follows the per-slot argmax).
"""
from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pressroom.spec_decode.dflash2 import DFlash2Config, DFlash2Drafter, DFlash2Proposer
from pressroom.spec_decode.proposer import Draft, DraftRequest

logger = logging.getLogger("pressroom")


class _Recorder:
    """A proposer that drafts nothing and keeps every verified position's target features."""

    def __init__(self) -> None:
        self.features: dict[str, list[torch.Tensor]] = {}

    def observe_features(self, req_id: str, rows: torch.Tensor) -> None:
        self.features.setdefault(req_id, []).append(rows.detach().float().cpu())

    def forget(self, req_ids: Iterable[str]) -> None:
        pass  # kept for training

    def propose(self, requests: list[DraftRequest]) -> dict[str, Draft]:
        return {}


@dataclass(slots=True)
class Sequence:
    tokens: list[int]  # prompt + generated
    features: torch.Tensor  # [len(tokens) - 1, layers * width]: position p's features predict token p + 1
    prompt_len: int


def record(llm, prompts: list[list[int]], max_tokens: int, layers: tuple[int, ...]) -> list[Sequence]:
    """Greedy continuations of `prompts` and the target features along them. The engine must compute
    every position: prefix caching off, and a KV cache that holds the batch (no preemption)."""
    from pressroom import SamplingParams
    if llm.engine.config.cache.enable_prefix_caching:
        raise ValueError("Recording needs every position computed: build the LLM with enable_prefix_caching=False.")
    runner = llm.engine.runner
    recorder = _Recorder()
    previous, runner.proposer = runner.proposer, recorder
    previous_layers, runner.model.model.aux_layers = runner.model.model.aux_layers, layers
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        runner.proposer, runner.model.model.aux_layers = previous, previous_layers
    # Internal request ids count up in submission order, which is also the order of the outputs.
    by_child = [recorder.features[k] for k in sorted(recorder.features, key=int)]
    sequences = []
    for out, feats in zip(outs, by_child, strict=True):
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        rows = torch.cat(feats)
        if len(rows) != len(tokens) - 1:
            raise RuntimeError(f"recorded {len(rows)} positions for {len(tokens)} tokens (a request was preempted: "
                               "record fewer prompts at a time or give the KV cache more room).")
        sequences.append(Sequence(tokens, rows, len(out.prompt_token_ids)))
    return sequences


def examples(seqs: list[Sequence], k: int) -> list[tuple[int, int]]:
    """(sequence, position p) pairs: context up to p, anchor p + 1, K labels after it. Serving drafts
    only after the first generated token, so the anchor is a generated token (p + 1 >= prompt_len):
    prompt positions, templated and easy, would teach little and inflate the acceptance report."""
    return [(i, p) for i, s in enumerate(seqs) for p in range(s.prompt_len - 1, len(s.tokens) - k - 1)]


def _batch(seqs: list[Sequence], items: list[tuple[int, int]], k: int, context: int):
    feats, masks, anchors, labels = [], [], [], []
    width = seqs[0].features.shape[1]
    for i, p in items:
        rows = seqs[i].features[max(0, p - context + 1):p + 1]
        pad = context - len(rows)
        feats.append(torch.cat([rows.new_zeros(pad, width), rows]))
        masks.append(torch.tensor([False] * pad + [True] * len(rows)))
        anchors.append(seqs[i].tokens[p + 1])
        labels.append(seqs[i].tokens[p + 2:p + 2 + k])
    return torch.stack(feats), torch.stack(masks), torch.tensor(anchors), torch.tensor(labels)


def slot_logits(drafter: DFlash2Drafter, target, feats, masks, anchors) -> torch.Tensor:
    """[batch, K, vocab] through the target's frozen embedding and LM head."""
    with torch.no_grad():
        anchor = target.model.embed_tokens(anchors).float()
    slots = drafter(feats, masks, anchor)
    return F.linear(slots, target.lm_head.weight.float())


def acceptance_length(drafter: DFlash2Drafter, target, seqs: list[Sequence], items, k: int, context: int) -> float:
    """Mean acceptance length greedy verification would see: 1 + the matching prefix of each block."""
    if not items:
        return 1.0
    with torch.no_grad():
        feats, masks, anchors, labels = _batch(seqs, items, k, context)
        drafted = slot_logits(drafter, target, feats, masks, anchors).argmax(-1)
        matched = (drafted == labels).int().cumprod(dim=1).sum(dim=1).float()
    return 1.0 + float(matched.mean())


def train(target_model, seqs: list[Sequence], cfg: DFlash2Config, steps: int, batch_size: int = 32,
          lr: float = 3e-3, held_out: float = 0.1, seed: int = 0, progress: bool = True
          ) -> tuple[DFlash2Drafter, dict]:
    """Trains a drafter (fp32, on the CPU) on the recorded sequences; returns it and a report."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    hf = target_model.config
    drafter = DFlash2Drafter(hf.hidden_size, cfg, hf.vocab_size)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    cut = max(1, int(len(seqs) * held_out))
    test_ids, train_ids = set(order[:cut]), set(order[cut:])
    context = DFlash2Proposer.context_len
    all_items = examples(seqs, cfg.block_size)
    train_items = [e for e in all_items if e[0] in train_ids]
    test_items = [e for e in all_items if e[0] in test_ids]
    if not train_items:
        raise ValueError("Too few tokens to train on: generate longer or more continuations.")
    before = acceptance_length(drafter, target_model, seqs, test_items, cfg.block_size, context)
    seen = rng.sample(train_items, min(512, len(train_items)))  # the same examples before and after
    seen_before = acceptance_length(drafter, target_model, seqs, seen, cfg.block_size, context)
    opt = torch.optim.AdamW([p for n, p in drafter.named_parameters() if not n.startswith("scorer")], lr=lr)
    losses = []
    bar = _bar(steps, progress)
    for _ in range(steps):
        items = rng.sample(train_items, min(batch_size, len(train_items)))
        feats, masks, anchors, labels = _batch(seqs, items, cfg.block_size, context)
        logits = slot_logits(drafter, target_model, feats, masks, anchors)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if bar is not None:
        bar.close()
    after = acceptance_length(drafter, target_model, seqs, test_items, cfg.block_size, context)
    report = {"train_examples": len(train_items), "held_out_examples": len(test_items), "steps": steps,
              "first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:]),
              "train_acceptance_length_before": round(seen_before, 3),
              "train_acceptance_length_after": round(
                  acceptance_length(drafter, target_model, seqs, seen, cfg.block_size, context), 3),
              "held_out_acceptance_length_before": round(before, 3),
              "held_out_acceptance_length_after": round(after, 3), "block_size": cfg.block_size}
    return drafter, report


def _bar(total: int, on: bool):
    if not on:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="train-drafter", unit="step")


def run_cli(args, engine_kwargs: dict) -> dict:
    """`pressroom train-drafter`: record, train, save the drafter and its report (report.json)."""
    import json
    import os

    from pressroom import LLM
    from pressroom.benchmarks.workload import read_prompt_texts
    from pressroom.spec_decode.dflash2 import save_drafter
    llm = LLM(**{**engine_kwargs, "enable_prefix_caching": False})
    tokenizer = llm.get_tokenizer()
    texts = read_prompt_texts(args.dataset_path)[:args.num_prompts]
    if args.chat:
        prompts = [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    else:
        prompts = [tokenizer.encode(t) for t in texts]
    layers = _layers(args.target_layers, llm.engine.hf_config.num_hidden_layers)
    seqs = []
    for i in range(0, len(prompts), args.record_batch):
        seqs += record(llm, prompts[i:i + args.record_batch], args.max_tokens, layers)
    cfg = DFlash2Config(block_size=args.draft_block_size, target_layers=layers, num_layers=args.num_layers,
                        num_heads=args.num_heads)
    drafter, report = train(llm.engine.model, seqs, cfg, args.steps, args.batch_size, args.lr)
    save_drafter(drafter, args.output)
    with open(os.path.join(args.output, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return report


def _layers(spec: str | None, num_layers: int) -> tuple[int, ...]:
    """Given layers ("1,15,28"), or three spread over the target's depth."""
    if spec:
        return tuple(int(x) for x in spec.split(","))
    return tuple(sorted({1, num_layers // 2, num_layers - 2}))
