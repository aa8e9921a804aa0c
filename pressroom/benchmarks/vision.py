"""`pressroom bench gpu --workloads image`: requests of one image and some text against HF transformers, in one run.

Each of --num-prompts requests holds --input-len random text tokens, then one --image-size square random image
(Qwen2.5-VL: `<|vision_start|>`, its placeholder rows, `<|vision_end|>`), and generates --output-len tokens,
ignoring EOS. The image is processed once (the model folder's PIL processor, as the engine's front-end would) and
shared by every request under a hash of its own, so every request runs the vision tower (the encoder cache never
hits; the tower's work does not depend on the pixels) and no two requests share prefix blocks. pressroom takes the
processed items (`mm_features`), HF the same pixel rows (batched `generate`, one `image_grid_thw` row a request),
on the very same dummy weights. Then the tower alone, one image: ms per image eagerly and through its CUDA graph
(host preparation included: that is what the graphs save on), where graphs were captured.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from pressroom.benchmarks.workload import random_prompts

if TYPE_CHECKING:
    from pressroom.benchmarks.gpu import Run

ENCODER_REPS = 10  # timed tower passes per mode (after 3 untimed)
NOTE = ("prompt: --input-len random text tokens, then one image (its placeholder rows between vision start and end "
        "tokens); the image processed once, each request under its own media hash (every request runs the tower, "
        "no prefix sharing); pressroom: offline engine, mm_features given; HF: batched generate on the same pixel "
        "rows and weights, greedy, EOS ignored; encoder ms: one image, wall time with the host's preparation, "
        "synchronized")


def _run(backend: str, prompts: list[list[int]], produced: int, elapsed: float, batch_size: int | None = None
         ) -> Run:
    """gpu.py's Run for a timed pass over `prompts`."""
    from pressroom.benchmarks.gpu import Run
    inputs = sum(map(len, prompts))
    return Run(backend, len(prompts), inputs, produced, round(elapsed, 4), round(produced / elapsed, 2),
               round(inputs / elapsed, 2), batch_size)


def image_requests(args, hf_config, num: int, seed: int) -> tuple[list[list[int]], list[list], dict]:
    """`num` prompts (token ids, placeholders expanded) and their media items, and the image's facts."""
    from PIL import Image

    from pressroom.multimodal.processor import MediaProcessor
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8))
    text = getattr(hf_config, "text_config", hf_config)
    special = getattr(hf_config, "bos_token_id", None) or text.bos_token_id or text.vocab_size
    texts = random_prompts(num, args.input_len, min(text.vocab_size, special), seed)  # below the special tokens
    image_ids = [hf_config.vision_start_token_id, hf_config.image_token_id, hf_config.vision_end_token_id]
    start = time.perf_counter()
    ids, (item,) = MediaProcessor(str(args.model), hf_config).process([0] * args.input_len + image_ids,
                                                                      {"image": [image]})
    processed_s = time.perf_counter() - start
    tail = ids[args.input_len:]
    items = [[dataclasses.replace(item, hash=f"{item.hash}:{seed}:{i}")] for i in range(num)]
    facts = {"image_size": args.image_size, "grid_thw": list(item.grid_thw), "patches": item.pixels_shape[0],
             "image_tokens": item.length, "prompt_tokens": len(ids), "processor_s": round(processed_s, 4)}
    return [t + tail for t in texts], items, facts


def run_pressroom_images(llm, prompts: list[list[int]], items: list[list], output_len: int,
                         device: torch.device) -> Run:
    from pressroom import SamplingParams
    from pressroom.benchmarks.gpu import sync
    from pressroom.sampling_params import RequestOutputKind
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # as LLM.generate asks
    engine = llm.engine
    sync(device)
    start = time.perf_counter()
    for i, (ids, media) in enumerate(zip(prompts, items)):
        engine.add_request(f"img-{id(prompts)}-{i}", {"prompt_token_ids": ids}, params, mm_features=media)
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    sync(device)
    elapsed = time.perf_counter() - start
    return _run("pressroom", prompts, produced, elapsed)


def encoder_ms(encode, item, device: torch.device, reps: int = ENCODER_REPS) -> float:
    """Mean wall ms of `encode([item])`, synchronized, after 3 untimed calls."""
    from pressroom.benchmarks.gpu import sync
    for _ in range(3):
        encode([item])
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        encode([item])
        sync(device)
        times.append(time.perf_counter() - start)
    return round(statistics.fmean(times) * 1e3, 3)


@torch.inference_mode()
def encoder_timings(llm, item, device: torch.device) -> dict:
    runner = llm.engine.core.executor.driver_worker.model_runner
    out = {"eager_ms_per_image": encoder_ms(runner.model.encode_media, item, device)}
    graphs = runner.encoder_graphs
    if graphs is not None:
        out["graphs_ms_per_image"] = encoder_ms(graphs.encode_media, item, device)
        out["graph_buckets"] = graphs.buckets
        out["eager_over_graphs"] = round(out["eager_ms_per_image"] / out["graphs_ms_per_image"], 3)
    return out


# ---- HF transformers ----

def hf_vl_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """pressroom's Qwen-VL weights under transformers 5's names (model.language_model., model.visual.)."""
    from pressroom.benchmarks.gpu import hf_state_dict
    state = {}
    for name, tensor in hf_state_dict(model).items():
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        state[name] = tensor
    return state


def build_hf_vl(model_path: Path, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForImageTextToText

    from pressroom.benchmarks.gpu import load_into_hf
    config = AutoConfig.from_pretrained(model_path)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation="sdpa")
    load_into_hf(model, state)
    model.generation_config.eos_token_id = None  # every request runs to its length
    model.generation_config.pad_token_id = 0
    return model.eval()


@torch.inference_mode()
def hf_generate_images(model, prompts: list[list[int]], items: list[list], output_len: int,
                       device: torch.device) -> int:
    ids = torch.tensor(prompts, device=device)
    pixels = torch.cat([m.pixel_tensor() for media in items for m in media]).to(device, model.dtype)
    grids = torch.tensor([m.grid_thw for media in items for m in media], device=device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                         image_grid_thw=grids, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                         max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    model.model.rope_deltas = None  # HF caches the last batch's M-RoPE offsets on the model
    return (out.shape[1] - ids.shape[1]) * ids.shape[0]


def run_hf_images(model, prompts, items, output_len: int, batch_size: int, device: torch.device) -> Run:
    from pressroom.benchmarks.gpu import sync
    batch_size = min(batch_size, len(prompts))
    hf_generate_images(model, prompts[:batch_size], items[:batch_size], output_len, device)  # warm-up, same shape
    sync(device)
    start = time.perf_counter()
    produced = sum(hf_generate_images(model, prompts[i:i + batch_size], items[i:i + batch_size], output_len, device)
                   for i in range(0, len(prompts), batch_size))
    sync(device)
    elapsed = time.perf_counter() - start
    return _run("hf", prompts, produced, elapsed, batch_size)


# ---- the run ----

def run_image(args) -> dict:
    import transformers

    from pressroom.benchmarks.gpu import (
        DTYPES,
        build_llm,
        device_machine,
        free_device_memory,
        pressroom_kwargs,
        resolve_device,
    )
    from pressroom.model.loader import load_hf_config
    device, dtype = resolve_device(args.device), DTYPES[args.dtype]
    hf_config = load_hf_config(str(args.model))
    prompts, items, facts = image_requests(args, hf_config, args.num_prompts, args.seed)
    warm_prompts, warm_items, _ = image_requests(args, hf_config, args.warmup_requests, args.seed + 1)
    kwargs, dropped = pressroom_kwargs(args, facts["prompt_tokens"] + args.output_len)
    llm, ready_s = build_llm(kwargs, device)
    if warm_prompts:
        run_pressroom_images(llm, warm_prompts, warm_items, args.output_len, device)
    runner = llm.engine.core.executor.driver_worker.model_runner
    runs_before = runner.multimodal.cache.encoder_runs
    ours = run_pressroom_images(llm, prompts, items, args.output_len, device)
    encoded = runner.multimodal.cache.encoder_runs - runs_before
    print(f"pressroom image: {ours.output_tokens_per_s:.1f} output tok/s ({ours.num_requests} requests, "
          f"{encoded} images encoded)", flush=True)
    encoder = encoder_timings(llm, items[0][0], device)
    print(f"encoder ms per image: {json.dumps(encoder)}", flush=True)
    state = None if args.skip_hf else hf_vl_state(llm.engine.model)  # views: the weights outlive the engine
    llm.shutdown()
    del llm, runner
    free_device_memory(device)
    hf_runs = []
    if state is not None:
        hf_model = build_hf_vl(Path(args.model), state, device, dtype)
        state.clear()
        hf_prompts, hf_items = prompts[:args.hf_max_requests], items[:args.hf_max_requests]
        for b in args.hf_batch_sizes:
            hf_runs.append(run_hf_images(hf_model, hf_prompts, hf_items, args.output_len, b, device))
            print(f"hf image batch {b}: {hf_runs[-1].output_tokens_per_s:.1f} output tok/s", flush=True)
        del hf_model
        free_device_memory(device)
    best = max(hf_runs, key=lambda r: r.output_tokens_per_s, default=None)
    report = {"benchmark": "gpu-image", "date": time.strftime("%Y-%m-%d %H:%M"), "machine": device_machine(device),
              "device": device.type, "model": str(args.model), "dtype": args.dtype, "engine_args": kwargs,
              "engine_args_not_supported": dropped, "time_to_ready_s": round(ready_s, 3),
              "transformers": transformers.__version__, "note": NOTE, "image": facts,
              "input_len": args.input_len, "output_len": args.output_len, "pressroom": dataclasses.asdict(ours),
              "images_encoded": encoded, "hf_by_batch_size": [dataclasses.asdict(r) for r in hf_runs],
              "hf": dataclasses.asdict(best) if best else None,
              "pressroom_over_hf": round(ours.output_tokens_per_s / best.output_tokens_per_s, 3) if best else None,
              "encoder": encoder}
    print(json.dumps({k: report[k] for k in ("pressroom_over_hf", "encoder", "images_encoded")}))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return report
