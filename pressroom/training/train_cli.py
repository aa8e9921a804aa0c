"""`pressroom train-drafter`: record the target's greedy answers to the prompts, train a drafter of the asked method
on them (training/drafter.py: DFlash2; training/dspark.py: DSpark) and save it with its report."""
from __future__ import annotations

import json
import logging
import os
import time

import torch

from pressroom.spec_decode.dflash2 import DFlash2Config, save_drafter
from pressroom.training import drafter as drafter_training
from pressroom.training import dspark
from pressroom.training.drafter import Schedule, Sequence, TrainingPaused, record
from pressroom.training.prompts import read_training_prompts

logger = logging.getLogger("pressroom")


def run_cli(args, engine_kwargs: dict) -> int:
    """`pressroom train-drafter`: record, train, save the drafter and its report (report.json). With
    --work-dir and --time-limit a call that runs out of time checkpoints and exits with 75 (EX_TEMPFAIL);
    the same command resumes it."""
    from pressroom import LLM
    start = time.perf_counter()
    deadline = time.monotonic() + args.time_limit if args.time_limit else None
    # The runner hands features over on the synchronous path; every position must be computed.
    llm = LLM(**{**engine_kwargs, "enable_prefix_caching": False, "async_scheduling": False})
    layers = _layers(args.target_layers, llm.engine.hf_config.num_hidden_layers)

    def recorded(path: str, limit: int | None, tag: str) -> list[Sequence]:
        items = read_training_prompts(path)[:limit]
        if args.chat:
            prompts = [llm.apply_chat_template([{"role": "user", "content": t}] if isinstance(t, str) else t)
                       for t in items]
        elif any(not isinstance(t, str) for t in items):
            raise ValueError(f"{path} holds conversations: train on them with --chat.")
        else:
            prompts = [llm.get_tokenizer().encode(t) for t in items]
        return record(llm, prompts, args.max_tokens, layers, args.record_batch, args.ignore_eos, args.work_dir,
                      tag, deadline)

    schedule = Schedule(args.steps, args.steps // 4 if args.scorer_steps is None else args.scorer_steps,
                        args.batch_size, args.lr, args.validation_fraction, args.eval_every, args.patience,
                        args.work_dir, args.checkpoint_every, deadline)
    try:
        seqs = recorded(args.dataset_path, args.num_prompts, "train")
        held_out = recorded(args.held_out_path, None, "heldout") if args.held_out_path else 0.1
        logger.info("train-drafter: %d sequences (%d tokens) recorded in %.1f s", len(seqs),
                    sum(len(s.tokens) for s in seqs), time.perf_counter() - start)
        target = llm.engine.model
        if args.method == "dspark":
            cfg = dspark.DSparkTrainConfig(args.draft_block_size, layers, args.num_layers, args.markov_rank,
                                           args.markov_head_type)
            drafter, report = dspark.train(target, seqs, cfg, schedule, held_out=held_out)
        else:
            cfg = DFlash2Config(block_size=args.draft_block_size, target_layers=layers, num_layers=args.num_layers,
                                num_heads=args.num_heads, rank=args.rank)
            drafter, report = drafter_training.train(target, seqs, cfg, args.steps, held_out=held_out,
                                                     schedule=schedule)
    except TrainingPaused as paused:
        print(f"train-drafter: {paused}; run the same command again to resume from {args.work_dir}")
        return 75
    if args.method == "dspark":
        dspark.save_drafter(drafter, target.config, args.output, dtype=getattr(torch, args.save_dtype))
    else:
        save_drafter(drafter, args.output, dtype=getattr(torch, args.save_dtype))
    report["sequences"] = len(seqs)
    report["seconds"] = round(time.perf_counter() - start, 1)
    with open(os.path.join(args.output, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 0


def _layers(spec: str | None, num_layers: int) -> tuple[int, ...]:
    """Given layers ("1,15,28"), or three spread over the target's depth."""
    if spec:
        return tuple(int(x) for x in spec.split(","))
    return tuple(sorted({1, num_layers // 2, num_layers - 2}))
