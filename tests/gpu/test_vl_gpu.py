"""Qwen2.5-VL on CUDA against HF transformers (fp32, tiny random weights): greedy tokens for 32 new tokens equal and
prompt logprobs within 1e-3, with 1-3 images per prompt beside a text-only prompt in one batch, and chunked prefill
splitting the image runs; encoder CUDA graphs on (every image through a bucket's replay, decodes through decode
graphs) and off (--enforce-eager), which must agree too. Token ids only (the GPU machine has no tokenizer files):
the images' placeholders are expanded on ids by the engine's processor."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pressroom import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200 machine)")]

NEW_TOKENS = 32
VOCAB, IMAGE, VIDEO, START, END = 256, 250, 251, 252, 253
PATCH, MERGE = 14, 2
BUCKETS = "64,128,256"  # tiny images: 16-64 patches each, so a step's images pack into one or two buckets
DEVICE = "cuda"  # the HF oracle's (a CPU run of these helpers sets "cpu" to check the plumbing)


@pytest.fixture(scope="module")
def tiny_vl_gpu(tmp_path_factory):
    import transformers
    path = tmp_path_factory.mktemp("tiny-qwen2_5_vl-gpu")
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         rms_norm_eps=1e-6, bos_token_id=240, eos_token_id=241),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                           spatial_merge_size=MERGE, temporal_patch_size=2, window_size=56, out_hidden_size=64,
                           fullatt_block_indexes=[1], tokens_per_second=2),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        bos_token_id=240, eos_token_id=241)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # larger weights than HF's init, so the vision tower's output moves the logits
        for name, param in model.named_parameters():
            if "visual" in name and param.dim() > 1:
                param.normal_(0, 0.2)
    model.save_pretrained(path)
    side = PATCH * MERGE
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2,
        "min_pixels": 4 * side * side, "max_pixels": 16 * side * side,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    return str(path), model.to(DEVICE)


def _image(seed: int, size: tuple[int, int]):
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _prompts() -> list[dict]:
    rng = np.random.default_rng(7)
    text = [rng.integers(1, 200, n).tolist() for n in (9, 5, 30, 4)]
    pad = [START, IMAGE, END]
    img = [_image(i, size) for i, size in enumerate([(100, 80), (60, 150), (112, 112), (90, 200)])]
    return [
        {"prompt_token_ids": text[0] + pad + text[1], "multi_modal_data": {"image": img[0]}},
        {"prompt_token_ids": text[1] + pad + text[3] + pad, "multi_modal_data": {"image": [img[1], img[2]]}},
        {"prompt_token_ids": text[2]},
        {"prompt_token_ids": pad + pad + text[3] + pad, "multi_modal_data": {"image": [img[3], img[0], img[1]]}},
    ]


@torch.inference_mode()
def _hf_reference(hf_model, llm: LLM, prompt: dict, ids: list[int]) -> tuple[list[int], list[float]]:
    ids_t = torch.tensor([ids], device=DEVICE)
    kwargs = {}
    images = (prompt.get("multi_modal_data") or {}).get("image")
    if images is not None:
        images = images if isinstance(images, list) else [images]
        processed = llm.engine.image_processor().hf(images=images, return_tensors="pt")
        kwargs = dict(pixel_values=processed["pixel_values"].to(DEVICE),
                      image_grid_thw=processed["image_grid_thw"].to(DEVICE), mm_token_type_ids=(ids_t == IMAGE).int())
    logits = hf_model(input_ids=ids_t, **kwargs).logits[0, :-1]
    lps = torch.log_softmax(logits.float(), -1).gather(1, ids_t[0, 1:, None])[:, 0].tolist()
    hf_model.model.rope_deltas = None
    out = hf_model.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=NEW_TOKENS,
                            min_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    hf_model.model.rope_deltas = None
    return out[0, len(ids):].tolist(), lps


def _generate(path: str, **engine) -> tuple[list, dict | None, LLM]:
    """Outputs of the four prompts in one batch, what the runner's encoder graphs did (None: not captured), and the
    engine (the caller shuts it down)."""
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_gib=0.5, max_num_seqs=8,
              encoder_cudagraph_sizes=BUCKETS, **engine)  # 8 sequences: 4 decode graphs to capture, not 67
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0,
                            detokenize=False)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    runner = llm.engine.core.executor.driver_worker.model_runner
    graphs = runner.encoder_graphs
    stats = None if graphs is None else {"padded_runs": graphs.padded_runs, "eager_items": graphs.eager_items,
                                         "decode_graphs": runner.graphs is not None}
    return outs, stats, llm


def _check_against_hf(llm, hf_model, outs) -> None:
    for prompt, out in zip(_prompts(), outs):
        tokens, lps = _hf_reference(hf_model, llm, prompt, out.prompt_token_ids)
        assert out.outputs[0].token_ids == tokens
        ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
        assert len(ours) == len(lps)
        assert max(abs(a - b) for a, b in zip(ours, lps)) < 1e-3


@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 24, "enable_prefix_caching": False},
                                    {"enforce_eager": True}], ids=["graphs", "graphs-chunked", "eager"])
def test_qwen2_5_vl_matches_hf_on_cuda(tiny_vl_gpu, engine):
    path, hf_model = tiny_vl_gpu
    outs, stats, llm = _generate(path, **engine)
    try:
        if engine.get("enforce_eager"):
            assert stats is None
        else:  # every image through a bucket's graph; decode steps through the decode graphs
            assert stats["padded_runs"] > 0 and stats["eager_items"] == 0 and stats["decode_graphs"]
        assert sum(o.prompt_token_ids.count(IMAGE) for o in outs) > 6  # placeholders expanded: one per row
        _check_against_hf(llm, hf_model, outs)
    finally:
        llm.shutdown()


def test_graphs_and_eager_agree(tiny_vl_gpu):
    path, _ = tiny_vl_gpu
    graphs, _, llm = _generate(path)
    llm.shutdown()
    eager, _, llm = _generate(path, enforce_eager=True)
    llm.shutdown()
    for a, b in zip(graphs, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        diffs = [abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob)
                 for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
        assert max(diffs) < 1e-4
