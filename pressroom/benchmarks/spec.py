"""`pressroom bench spec`: the adaptive speculative token budget against no speculation and every fixed K.

One process. `--method draft_model` (default): a target and a draft model on dummy weights, drafts accepted
with synthetic per-position rates (decaying like a real drafter's), so the figures measure the system cost
of speculation at real shapes. `--method dflash2`: a real target (default the embedded model) and its real
block drafter on real prompts (`--dataset-path`, as chat turns), real acceptance: the CPU's case. Each
engine configuration (no speculation, fixed K = 1..7, adaptive with K at most 7) is built once and run at
every concurrency (or, with `--rounds`, all at once, taking turns): a closed loop keeps c requests in flight
(a finished one is replaced at once) until N requests are done. Output tokens per second, acceptance length
and draft tokens verified per step come from the engine's own counters. Runs on the CPU too (tiny model),
so CI checks it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pressroom.benchmarks.gpu import (
    DTYPES,
    allocated_bytes,
    build_llm,
    device_machine,
    free_device_memory,
    hf_state_dict,
    positive_ints,
    reset_prefix_cache,
    resolve_device,
    sync,
)
from pressroom.benchmarks.shapes import resolve_shape, shape_arg, shape_help
from pressroom.benchmarks.workload import random_prompts

DEFAULT_TARGET, DEFAULT_DRAFT = "llama-3.1-8b", "llama-3.2-1b"  # shapes shipped in the package (same vocabulary)
DEFAULT_RATES = [0.85, 0.75, 0.65, 0.55, 0.45, 0.35, 0.25]
NONE, NONE_SYNC, ADAPTIVE = "none", "none-sync", "adaptive"
TOLERANCE = 0.05  # the "never more than 5% below the best fixed K"
WARMUP_NOTE = ("per engine, untimed: at each concurrency c, 2c requests of --warmup-output-len tokens in the closed "
               "loop (new prompts joining running ones: the mixed steps' kernels compiled too), then the prefix "
               "cache reset; the adaptive budget keeps what it learned")


@dataclass(slots=True)
class Variant:
    name: str  # "none", "none-sync", "K=3", "adaptive"
    k: int  # drafts per step at most; 0: no speculation
    adaptive: bool = False
    sync: bool = False  # no speculation, synchronous scheduling: like with like where speculation runs synchronously

    def speculative_config(self, args) -> dict | None:
        if self.k == 0:
            return None
        if args.method == "dflash2":
            config = {"method": "dflash2", "num_speculative_tokens": self.k, "adaptive_token_budget": self.adaptive}
            return config | ({"model": str(args.draft_model)} if args.draft_model else {})
        return {"method": "draft_model", "model": str(args.draft_checkpoint), "num_speculative_tokens": self.k,
                "adaptive_token_budget": self.adaptive, "rejection_sample_method": "synthetic",
                "synthetic_acceptance_rates": list(args.acceptance_rates)}


@dataclass(slots=True)
class Cell:
    """One configuration at one concurrency."""
    variant: str
    concurrency: int
    num_requests: int
    output_tokens: int
    elapsed_s: float
    output_tokens_per_s: float
    engine_steps: int
    request_steps: int  # sampling events: each emits 1 + accepted tokens
    num_drafts: int | None = None  # request-steps that verified at least one draft
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    mean_acceptance_length: float | None = None  # vLLM's: 1 + accepted / drafts
    draft_tokens_per_verify: float | None = None  # per request-step that verified drafts
    draft_tokens_per_request_step: float | None = None  # over every request-step (adaptive: how many it kept)
    accepted_per_pos: list[int] | None = None


def variants(args, device: torch.device) -> list[Variant]:
    out = [Variant(NONE, 0)]
    if args.sync_baseline and device.type == "cuda":  # on the CPU no speculation is synchronous already
        out.append(Variant(NONE_SYNC, 0, sync=True))
    out += [Variant(f"K={k}", k) for k in args.k_values]
    if not args.skip_adaptive:
        out.append(Variant(ADAPTIVE, args.max_k, adaptive=True))
    return out


def num_requests(concurrency: int, args) -> int:
    """Enough requests for a few waves at low concurrency, capped so the whole run fits one device call."""
    return min(max(args.requests_per_slot * concurrency, args.min_requests), max(args.max_requests, concurrency))


# ---- the drafter's weights ----

def has_weights(path: Path) -> bool:
    return path.is_file() or any(path.glob("*.safetensors")) or any(path.glob("*.gguf"))


def random_draft_checkpoint(config_dir: Path, dtype: str, device: torch.device) -> Path:
    """A checkpoint of random weights for a config-only drafter: the draft-model proposer loads its model
    from files (it takes no load format), so dummy weights are written once to a temporary directory."""
    from safetensors.torch import save_file

    from pressroom.config import ModelConfig, resolve_dtype
    from pressroom.model.loader import load_model
    loaded = load_model(ModelConfig(model=str(config_dir), load_format="dummy", dtype=resolve_dtype(dtype, device.type),
                                    skip_tokenizer_init=True, quantization="none"), device.type)
    state = hf_state_dict(loaded.model)
    if loaded.model.tie_word_embeddings:
        state.pop("lm_head.weight")  # shares the embedding's memory; HF checkpoints leave it out too
    out = Path(tempfile.mkdtemp(prefix="pressroom-draft-"))
    shutil.copy(config_dir / "config.json", out / "config.json")
    save_file({name: t.detach().contiguous().cpu() for name, t in state.items()}, str(out / "model.safetensors"))
    del loaded, state
    free_device_memory(device)
    return out


# ---- one engine ----

def engine_kwargs(args, variant: Variant, max_model_len: int) -> dict:
    real = args.method == "dflash2"  # the target's own weights: real drafts need them
    kwargs = {"model": args.model and str(args.model), "load_format": "auto" if real else "dummy",
              "dtype": args.dtype, "device": args.device,
              "max_model_len": max_model_len, "max_num_seqs": max(args.concurrency),
              "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_memory_gib": args.kv_cache_memory_gib,
              "enforce_eager": args.enforce_eager, "skip_tokenizer_init": True, "seed": args.seed,
              "speculative_config": variant.speculative_config(args)}
    if variant.sync:
        kwargs["async_scheduling"] = False
    if args.num_threads:
        kwargs["num_threads"] = args.num_threads
    return kwargs


def run_variant(args, variant: Variant, prompts: dict[int, list[list[int]]], max_model_len: int,
                device: torch.device, log) -> tuple[list[Cell], dict]:
    llm, meta = start_engine(args, variant, prompts, max_model_len, device, log)
    cells = []
    for c in args.concurrency:
        cells.append(measure_logged(llm, variant.name, prompts[c], c, args, device, log))
    meta = finish_engine(llm, variant, meta, device, log)
    return cells, meta


def start_engine(args, variant: Variant, prompts: dict[int, list[list[int]]], max_model_len: int,
                 device: torch.device, log):
    """The variant's engine, warmed up at every concurrency (each shape's kernels compiled)."""
    kwargs = engine_kwargs(args, variant, max_model_len)
    llm, ready_s = build_llm(kwargs, device)
    log(f"{variant.name}: engine ready in {ready_s:.1f} s")
    for c in args.concurrency:
        warmup = (prompts[c] if args.method == "dflash2" else
                  random_prompts(2 * c, args.input_len, llm.engine.vocab_size, args.seed + 1000 + c))
        drive(llm.engine, warmup, c, args.warmup_output_len, f"warmup-c{c}")
    reset_prefix_cache(llm)
    log(f"{variant.name}: warmed up")
    return llm, {"engine_args": kwargs, "time_to_ready_s": round(ready_s, 3)}


def measure_logged(llm, name: str, prompts: list[list[int]], c: int, args, device: torch.device, log) -> Cell:
    cell = measure(llm.engine, name, prompts, c, args.output_len, device)
    log(f"{name} @ {c}: {cell.output_tokens_per_s:.1f} tok/s ({cell.num_requests} requests, "
        f"{cell.elapsed_s:.1f} s, AL {_fmt(cell.mean_acceptance_length, 0, '.2f').strip()}, "
        f"drafts/request-step {_fmt(cell.draft_tokens_per_request_step, 0, '.2f').strip()})")
    reset_prefix_cache(llm)
    return cell


def finish_engine(llm, variant: Variant, meta: dict, device: torch.device, log) -> dict:
    meta |= {"async_scheduling": llm.engine.config.scheduler.async_scheduling,
             "adaptive_budget": budget_curves(llm.engine.scheduler.spec_budget)}
    llm.shutdown()  # the caller still holds the LLM: deleting this name alone would free nothing
    free_device_memory(device)
    if device.type == "cuda":  # a leak would show here
        log(f"{variant.name}: engine freed, {allocated_bytes(device) / (1 << 30):.2f} GiB still allocated")
    return meta


def run_interleaved(args, todo: list[Variant], prompts: dict[int, list[list[int]]], max_model_len: int,
                    device: torch.device, log) -> tuple[dict[int, dict[str, Cell]], dict[str, dict]]:
    """--rounds N: every engine up at once; at each concurrency each round runs every variant in turn (the
    order rotating), and a cell keeps its fastest round. On a shared, noisy machine, minutes apart, one
    engine can run 25% slower than the next for nothing it did; side by side, the noise falls on all."""
    engines = {v.name: start_engine(args, v, prompts, max_model_len, device, log) for v in todo}
    cells: dict[int, dict[str, Cell]] = {c: {} for c in args.concurrency}
    for c in args.concurrency:
        for r in range(args.rounds):
            for v in todo[r % len(todo):] + todo[:r % len(todo)]:
                cell = measure_logged(engines[v.name][0], v.name, prompts[c], c, args, device, log)
                best = cells[c].get(v.name)
                if best is None or cell.output_tokens_per_s > best.output_tokens_per_s:
                    cells[c][v.name] = cell
    metas = {v.name: finish_engine(engines[v.name][0], v, engines[v.name][1], device, log) for v in todo}
    return cells, metas


def budget_curves(budget) -> dict | None:
    """The step costs the adaptive budget profiled at start-up, and what it learned (per-position acceptance)."""
    if budget is None:
        return None
    return {"verify_costs": budget.costs, "decode_costs": budget.decode_costs,
            "draft_costs": budget.draft_costs, "first_draft_costs": budget.first_draft_costs,
            "attention_cost_per_context_token": budget.attention_cost,
            "learned_acceptance": [round(a, 4) for a in budget.shared.rates]}


def measure(engine, name: str, prompts: list[list[int]], concurrency: int, output_len: int,
            device: torch.device) -> Cell:
    before = engine.stats().spec
    sync(device)
    start = time.perf_counter()
    produced, steps = drive(engine, prompts, concurrency, output_len, f"{name}-c{concurrency}")
    sync(device)
    elapsed = time.perf_counter() - start
    after = engine.stats().spec
    return make_cell(name, concurrency, len(prompts), produced, elapsed, steps, before, after)


def drive(engine, prompts: list[list[int]], concurrency: int, output_len: int, tag: str) -> tuple[int, int]:
    """Closed loop: `concurrency` requests in flight, each finished one replaced by the next prompt.
    Returns (output tokens, engine steps)."""
    from pressroom import SamplingParams
    from pressroom.sampling_params import RequestOutputKind
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    queue = list(enumerate(prompts))[::-1]

    def submit(n: int) -> None:
        for _ in range(min(n, len(queue))):
            i, prompt = queue.pop()
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)

    submit(concurrency)
    produced = steps = 0
    while engine.has_unfinished_requests():
        done = [o for o in engine.step() if o.finished]
        steps += 1
        produced += sum(len(o.outputs[0].token_ids) for o in done)
        submit(len(done))
    return produced, steps


def make_cell(name: str, concurrency: int, requests: int, produced: int, elapsed: float, steps: int,
              before, after) -> Cell:
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    request_steps = produced - accepted
    cell = Cell(name, concurrency, requests, produced, round(elapsed, 4), round(produced / elapsed, 2), steps,
                request_steps)
    if name in (NONE, NONE_SYNC):
        return cell  # no drafts: the acceptance fields stay empty
    earlier = before.accepted_per_pos + [0] * (len(after.accepted_per_pos) - len(before.accepted_per_pos))
    per_pos = [a - b for a, b in zip(after.accepted_per_pos, earlier)]
    cell.num_drafts, cell.num_draft_tokens, cell.num_accepted_tokens = drafts, draft_tokens, accepted
    cell.mean_acceptance_length = round(1 + accepted / drafts, 4) if drafts else None
    cell.draft_tokens_per_verify = round(draft_tokens / drafts, 4) if drafts else None
    cell.draft_tokens_per_request_step = round(draft_tokens / request_steps, 4) if request_steps else None
    cell.accepted_per_pos = per_pos
    return cell


# ---- the comparison ----

def summarize(cells: dict[str, Cell], concurrency: int, args) -> dict:
    """Ratios of the adaptive budget against no speculation and the fixed K's, and the issue's conditions."""
    rate = {name: cell.output_tokens_per_s for name, cell in cells.items()}
    fixed = {name: r for name, r in rate.items() if name.startswith("K=")}
    best_name = max(fixed, key=fixed.get) if fixed else None
    max_k = f"K={args.max_k}"
    out = {"best_fixed": best_name, "best_fixed_tokens_per_s": fixed.get(best_name),
           "fixed_over_none": {n: _ratio(r, rate[NONE]) for n, r in fixed.items()}}
    if ADAPTIVE not in rate:
        return out
    ours = rate[ADAPTIVE]
    out.update({"adaptive_over_none": _ratio(ours, rate[NONE]),
                "adaptive_over_none_sync": _ratio(ours, rate.get(NONE_SYNC)),
                "adaptive_over_best_fixed": _ratio(ours, fixed.get(best_name)),
                "adaptive_over_max_k": _ratio(ours, rate.get(max_k))})
    conditions = {"adaptive >= none": out["adaptive_over_none"] >= 1.0}
    if best_name is not None:
        conditions[f"adaptive >= {1 - TOLERANCE:.2f} x best fixed K"] = \
            out["adaptive_over_best_fixed"] >= 1 - TOLERANCE
    if concurrency in args.beat_max_k_at and max_k in rate:
        conditions[f"adaptive > {max_k}"] = out["adaptive_over_max_k"] > 1.0
    out["conditions"] = conditions
    return out


def expected_acceptance_length(rates: list[float], k: int) -> float:
    """1 + expected accepted drafts of k, position j accepted with rates[j] (the last rate repeats) given
    the ones before it were: what a fixed K's measured acceptance length should come close to."""
    survival, total = 1.0, 1.0
    for j in range(k):
        survival *= rates[min(j, len(rates) - 1)]
        total += survival
    return round(total, 4)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def print_report(report: dict) -> None:
    names = list(report["engines"])
    rates = report["acceptance_rates"]
    print(f"\n== bench spec: {Path(report['target']).name} + {report['method']} {Path(report['draft_model']).name} "
          f"({report['dtype']}) on {report['device']}; "
          f"{f'synthetic acceptance {rates}' if rates else 'real acceptance'} ==")
    print("output tok/s")
    print(f"{'conc':>5}" + "".join(f"{n:>10}" for n in names)
          + f"{'ad/none':>9}{'ad/best':>9}{'best':>6}{'ad/Kmax':>9}")
    for c, row in report["cells"].items():
        s = report["summary"][c]
        print(f"{c:>5}" + "".join(f"{row[n]['output_tokens_per_s']:>10.1f}" for n in names)
              + _fmt(s.get("adaptive_over_none"), 9, ".3f") + _fmt(s.get("adaptive_over_best_fixed"), 9, ".3f")
              + f"{(s['best_fixed'] or '-'):>6}" + _fmt(s.get("adaptive_over_max_k"), 9, ".3f"))
    expected = ", ".join(f"{n} {v:.2f}" for n, v in report["expected_acceptance_length"].items())
    print("mean acceptance length / draft tokens verified per request-step"
          + (f" (expected AL: {expected})" if expected else ""))
    spec_names = [n for n in names if n not in (NONE, NONE_SYNC)]
    print(f"{'conc':>5}" + "".join(f"{n:>12}" for n in spec_names))
    for c, row in report["cells"].items():
        print(f"{c:>5}" + "".join(f"{_pair(row[n]):>12}" for n in spec_names))
    for c, s in report["summary"].items():
        held = ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in s.get("conditions", {}).items())
        print(f"concurrency {c}: {held or '-'}")
    if report["all_conditions_hold"] is not None:
        print(f"all conditions hold: {'yes' if report['all_conditions_hold'] else 'NO'}")


def _pair(cell: dict) -> str:
    al, per_step = cell["mean_acceptance_length"], cell["draft_tokens_per_request_step"]
    return f"{'-' if al is None else f'{al:.2f}'}/{'-' if per_step is None else f'{per_step:.2f}'}"


def _fmt(value: float | None, width: int, spec: str) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


# ---- the whole run ----

def run(args) -> dict:
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - started:6.1f}s] {message}", flush=True)

    device = resolve_device(args.device)
    if args.max_k < 1:
        raise ValueError(f"--max-k must be at least 1, got {args.max_k}.")
    if args.kv_cache_memory_gib is None:
        args.kv_cache_memory_gib = 16.0 if device.type == "cuda" else 0.5
    if args.method == "dflash2" and args.dataset_path is None:
        raise ValueError("--method dflash2 needs --dataset-path, its prompts (JSONL or one a line; the held-out "
                         "chat prompts are benchmarks/data/chat_heldout.jsonl in a source checkout).")
    if args.method == "draft_model":
        args.model = args.model or str(resolve_shape(DEFAULT_TARGET))
        args.draft_model = args.draft_model or str(resolve_shape(DEFAULT_DRAFT))
    prompts = make_prompts(args)
    longest = max(len(p) for row in prompts.values() for p in row)
    max_model_len = longest + args.output_len + args.max_k + 8
    log(f"requests per concurrency: {', '.join(f'{c}: {len(p)}' for c, p in prompts.items())}")
    if args.method == "dflash2":
        args.draft_checkpoint = args.draft_model
        return run_all(args, device, prompts, max_model_len, started, log)
    args.draft_checkpoint = Path(args.draft_model)
    if not has_weights(args.draft_checkpoint):
        args.draft_checkpoint = random_draft_checkpoint(args.draft_checkpoint, args.dtype, device)
        log(f"random draft weights for {args.draft_model} written to {args.draft_checkpoint}")
    try:
        return run_all(args, device, prompts, max_model_len, started, log)
    finally:
        if args.draft_checkpoint != Path(args.draft_model):
            shutil.rmtree(args.draft_checkpoint, ignore_errors=True)


def make_prompts(args) -> dict[int, list[list[int]]]:
    """Per concurrency, its requests' prompts: random tokens (dummy weights), or the dataset's prompts as chat
    turns of the real target's template, cycled (dflash2)."""
    from pressroom.model.loader import load_hf_config, load_tokenizer, resolve_model_path
    if args.method != "dflash2":
        vocab = load_hf_config(str(args.model)).vocab_size
        return {c: random_prompts(num_requests(c, args), args.input_len, vocab, args.seed + i)
                for i, c in enumerate(args.concurrency)}
    from pressroom.benchmarks.workload import file_prompts
    tokenizer = load_tokenizer(resolve_model_path(args.model and str(args.model)))
    return {c: file_prompts(args.dataset_path, tokenizer, num_requests(c, args), None, chat=True)
            for c in args.concurrency}


def run_all(args, device: torch.device, prompts: dict[int, list[list[int]]], max_model_len: int, started: float,
            log) -> dict:
    cells: dict[int, dict[str, Cell]] = {c: {} for c in args.concurrency}
    engines: dict[str, dict] = {}
    todo = variants(args, device)
    if args.rounds > 1:
        cells, engines = run_interleaved(args, todo, prompts, max_model_len, device, log)
    else:
        for variant in todo:
            done, engines[variant.name] = run_variant(args, variant, prompts, max_model_len, device, log)
            for cell in done:
                cells[cell.concurrency][variant.name] = cell
            write_report(args, device, prompts, engines, cells, started, len(todo))  # a run cut short keeps these
    report = write_report(args, device, prompts, engines, cells, started, len(todo))
    print_report(report)
    log("done")
    return report


def write_report(args, device: torch.device, prompts: dict[int, list[list[int]]], engines: dict[str, dict],
                 cells: dict[int, dict[str, Cell]], started: float, num_variants: int) -> dict:
    report = make_report(args, device, prompts, engines, cells, time.perf_counter() - started)
    report["complete"] = len(engines) == num_variants
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return report


def make_report(args, device: torch.device, prompts: dict[int, list[list[int]]], engines: dict[str, dict],
                cells: dict[int, dict[str, Cell]], elapsed: float) -> dict:
    summary = {str(c): summarize(row, c, args) for c, row in cells.items()}
    checks = [v for s in summary.values() for v in s.get("conditions", {}).values()]
    synthetic = args.method == "draft_model"
    return {"benchmark": "spec", "date": time.strftime("%Y-%m-%d %H:%M"), "machine": device_machine(device),
            "device": device.type, "method": args.method, "target": str(args.model or "embedded"),
            "draft_model": str(args.draft_model or "embedded"),
            "draft_weights": "random (dummy)" if synthetic and args.draft_checkpoint != Path(args.draft_model)
            else "checkpoint",
            "dtype": args.dtype, "acceptance_rates": list(args.acceptance_rates) if synthetic else None,
            "dataset_path": None if synthetic else args.dataset_path, "input_len": args.input_len,
            "output_len": args.output_len, "concurrency": list(args.concurrency), "k_values": list(args.k_values),
            "max_k": args.max_k, "rounds": args.rounds, "warmup_note": WARMUP_NOTE,
            "expected_acceptance_length": {f"K={k}": expected_acceptance_length(args.acceptance_rates, k)
                                           for k in args.k_values} if synthetic else {},
            "requests": {str(c): len(p) for c, p in prompts.items()}, "engines": engines,
            "cells": {str(c): {n: asdict(cell) for n, cell in row.items()} for c, row in cells.items()},
            "summary": summary, "all_conditions_hold": all(checks) if checks else None, "total_s": round(elapsed, 1)}


# ---- command line ----

def _rates(text: str) -> list[float]:
    try:
        values = [float(n) for n in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected probabilities in [0, 1], comma-separated; got {text!r}")
    return values


def add_spec_bench_args(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--method", default="draft_model", choices=["draft_model", "dflash2"],
                   help="draft_model: dummy weights, synthetic acceptance; dflash2: real weights, prompts, acceptance")
    p.add_argument("--model", type=shape_arg, default=None,
                   help=shape_help(f"the target (default: {DEFAULT_TARGET}, dummy weights; dflash2: the embedded "
                                   "model)"))
    p.add_argument("--draft-model", type=shape_arg, default=None,
                   help=shape_help(f"the drafter (default: {DEFAULT_DRAFT}; dflash2: the embedded model's drafter)"))
    p.add_argument("--dataset-path", default=None,
                   help="dflash2 (required): the prompts (each one user turn of the chat template), cycled; "
                        "e.g. benchmarks/data/chat_heldout.jsonl in a source checkout")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda, or cpu to test the plumbing with a tiny model")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="both models' dtype")
    p.add_argument("--acceptance-rates", type=_rates, default=DEFAULT_RATES,
                   help="comma-separated synthetic conditional acceptance per draft position (the last repeats)")
    p.add_argument("--concurrency", type=positive_ints, default=[1, 4, 16, 64, 256],
                   help="comma-separated requests in flight")
    p.add_argument("--k-values", type=positive_ints, default=[1, 2, 3, 4, 5, 6, 7],
                   help="comma-separated fixed K configurations")
    p.add_argument("--max-k", type=int, default=7, help="the adaptive budget's K at most")
    p.add_argument("--skip-adaptive", action="store_true", help="no adaptive-budget engine")
    p.add_argument("--sync-baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="also no speculation with synchronous scheduling (CUDA only): the like-for-like baseline "
                        "where speculation runs synchronously")
    p.add_argument("--beat-max-k-at", type=positive_ints, default=[64, 256],
                   help="comma-separated concurrencies where the adaptive budget must beat fixed K = --max-k")
    p.add_argument("--input-len", type=int, default=128, help="prompt length")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--requests-per-slot", type=int, default=2, help="N = this x concurrency, then clamped")
    p.add_argument("--min-requests", type=int, default=4, help="N at least")
    p.add_argument("--max-requests", type=int, default=512, help="N at most (but at least the concurrency)")
    p.add_argument("--rounds", type=int, default=1,
                   help="above 1: every engine at once, the variants taking turns this many times per concurrency, "
                        "each cell its fastest round (for noisy machines; the engines must fit side by side)")
    p.add_argument("--warmup-output-len", type=int, default=16, help="output tokens of each warm-up request")
    p.add_argument("--seed", type=int, default=0, help="seeds the random prompts and the dummy weights")
    p.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help="KV-cache size in GiB (default: 16 on cuda, 0.5 on cpu)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="tokens one engine step computes at most")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (CPU runs; default: torch's)")
    p.add_argument("--output-json", default=None, help="write the report here too (default: print only)")
