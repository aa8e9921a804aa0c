"""Qwen2.5-VL equals HF transformers' Qwen2_5_VLForConditionalGeneration on tiny random weights (fp32): greedy
tokens for 32 new tokens and prompt logprobs, with 1-3 images per prompt beside a text-only prompt in one batch,
and with chunked prefill splitting the image runs. The vision tower has windowed and full attention blocks and
images of several shapes (windows padded at the edges); M-RoPE's sections differ in size."""
from __future__ import annotations

import torch
from tiny_vl import random_image

from pressroom import LLM, SamplingParams

NEW_TOKENS = 32
PAD = "<|vision_start|><|image_pad|><|vision_end|>"


def _prompts():
    img = [random_image(i, size) for i, size in enumerate([(100, 80), (60, 150), (112, 112), (90, 200)])]
    return [
        {"prompt": f"<|im_start|>user\n{PAD}What is in this picture?<|im_end|>\n<|im_start|>assistant\n",
         "multi_modal_data": {"image": img[0]}},
        {"prompt": f"Compare {PAD} with {PAD} please.", "multi_modal_data": {"image": [img[1], img[2]]}},
        {"prompt": "A prompt of text alone, with no image in it at all."},
        {"prompt": f"{PAD}{PAD} three {PAD} images", "multi_modal_data": {"image": [img[3], img[0], img[1]]}},
    ]


@torch.inference_mode()
def _hf_reference(hf_model, llm: LLM, prompt: dict, token_ids: list[int]) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and prompt logprobs on the same ids and the same image processor's pixels."""
    ids = torch.tensor([token_ids])
    kwargs = {}
    images = (prompt.get("multi_modal_data") or {}).get("image")
    if images is not None:
        images = images if isinstance(images, list) else [images]
        processed = llm.engine.image_processor().hf(images=images, return_tensors="pt")
        kwargs = dict(pixel_values=processed["pixel_values"])
        if "image_grid_thw" in processed:  # Qwen-VL
            kwargs.update(image_grid_thw=processed["image_grid_thw"],
                          mm_token_type_ids=(ids == hf_model.config.image_token_id).int())
    logits = hf_model(input_ids=ids, **kwargs).logits[0, :-1]
    lps = torch.log_softmax(logits.float(), -1).gather(1, ids[0, 1:, None])[:, 0].tolist()
    hf_model.model.rope_deltas = None
    out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                            do_sample=False, min_new_tokens=NEW_TOKENS, **kwargs)
    hf_model.model.rope_deltas = None
    return out[0, len(token_ids):].tolist(), lps


_REFERENCES: dict[tuple, tuple[list[int], list[float]]] = {}  # HF's, shared by the tests


def _check(llm: LLM, hf_model, prompts: list[dict]) -> None:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        key = (id(hf_model), tuple(out.prompt_token_ids))
        if key not in _REFERENCES:
            _REFERENCES[key] = _hf_reference(hf_model, llm, prompt, out.prompt_token_ids)
        tokens, lps = _REFERENCES[key]
        assert out.outputs[0].token_ids == tokens
        ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
        assert len(ours) == len(lps)
        assert max(abs(a - b) for a, b in zip(ours, lps)) < 1e-3


def test_images_match_hf_in_one_batch(tiny_vl):
    path, hf_model = tiny_vl
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05)
    prompts = _prompts()
    _check(llm, hf_model, prompts)
    out = llm.generate(prompts[1], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids.count(hf_model.config.image_token_id) > 2  # one placeholder per encoder row


def test_chunked_prefill_splits_image_runs_and_preemption_recomputes_them(tiny_vl):
    path, hf_model = tiny_vl
    # 8 tokens a step; 10 blocks of 16 hold two of the three requests (5 blocks each at the end): preemption
    llm = LLM(path, dtype="float32", num_gpu_blocks_override=10, max_num_batched_tokens=8, max_num_seqs=4,
              enable_prefix_caching=False)
    prompts = [p for p in _prompts() if "multi_modal_data" in p]
    _check(llm, hf_model, prompts)
    _, items = llm.engine.process_media(prompts[2], llm.engine.tokenize_prompt(prompts[2])[1])
    assert max(m.length for m in items) > 8  # a step of 8 tokens cannot hold the run: chunks split it
    assert llm.engine.stats().num_preemptions > 0
    # each image once, though its run took steps and its request was recomputed (its rows stayed cached)
    assert llm.engine.runner.multimodal.cache.encoder_runs == 4
