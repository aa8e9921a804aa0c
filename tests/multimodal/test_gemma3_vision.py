"""Gemma 3 with its SigLIP tower equals HF transformers' Gemma3ForConditionalGeneration on tiny random weights (fp32):
greedy tokens for 32 new tokens and prompt logprobs, with 1-2 images per prompt beside a text-only prompt in one
batch, and with chunks whose token budget would end inside an image's run of tokens.

Gemma 3's image tokens attend bidirectionally within their run (HF's token_type_ids mask), in its sliding-window
layers too; the scheduler keeps a run in one chunk, which the chunked test would fail without: a chunk ending
inside a run computes its first tokens before the rest exists."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from tiny_vl import png_data_url, random_image

from pressroom import LLM, SamplingParams
from pressroom.core.media_schedule import whole_run_chunk
from pressroom.multimodal.inputs import MediaItem

NEW_TOKENS = 32
IMAGE_TOKENS = 16  # 32x32 images, 4x4 patches (8x8 a side), pooled 2x2: 16 rows an image
BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# Gemma 3's template's shape: an image part is written as <start_of_image>
CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def build_tiny_gemma3(path: Path, smollm_tokenizer, seed: int = 0):
    """A tiny Gemma 3 (SigLIP tower, sliding-window and global text layers) with Gemma 3's image tokens added to the
    SmolLM2 tokenizer and its PIL image processor, saved under `path`; returns the HF model (fp32, eval)."""
    import transformers
    tok = smollm_tokenizer
    tok.add_special_tokens({"additional_special_tokens": [BOI, EOI, IMAGE]})
    ids = {t: tok.convert_tokens_to_ids(t) for t in (BOI, EOI, IMAGE)}
    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=-(-len(tok) // 64) * 64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         sliding_window=12, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         max_position_embeddings=512, query_pre_attn_scalar=16, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=4, vision_use_head=False),
        mm_tokens_per_image=IMAGE_TOKENS, boi_token_index=ids[BOI], eoi_token_index=ids[EOI],
        image_token_index=ids[IMAGE])
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # away from HF's init: the tower's output moves the logits, Gemma's (1 + w) norms matter
        for name, param in model.named_parameters():
            if ("vision_tower" in name or "projector" in name) and param.dim() > 1:
                param.normal_(0, 0.2)
            elif "norm" in name and "vision_tower" not in name:
                param.normal_(0, 0.2)
    model.save_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    (Path(path) / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "do_resize": True, "size": {"height": 32, "width": 32}, "resample": 2, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_pan_and_scan": False}))
    return model


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory, smollm_tokenizer):
    path = tmp_path_factory.mktemp("tiny-gemma3")
    return str(path), build_tiny_gemma3(path, copy.deepcopy(smollm_tokenizer))


def _prompts():
    img = [random_image(40 + i, size) for i, size in enumerate([(100, 80), (60, 150), (40, 40)])]
    return [
        {"prompt": f"A picture: {BOI} What is in it? Say it in a few words.", "multi_modal_data": {"image": img[0]}},
        {"prompt": "Text alone in this one, no picture at all, a little longer."},
        {"prompt": f"Compare {BOI} with{BOI}, please.", "multi_modal_data": {"image": [img[1], img[2]]}},
    ]


@torch.inference_mode()
def _hf_reference(hf_model, llm: LLM, prompt: dict, token_ids: list[int]) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and prompt logprobs on the same ids and pixels, image tokens marked in token_type_ids
    (HF's bidirectional mask over each run)."""
    ids = torch.tensor([token_ids])
    kwargs = {}
    images = (prompt.get("multi_modal_data") or {}).get("image")
    if images is not None:
        images = images if isinstance(images, list) else [images]
        pixels = llm.engine.image_processor().hf(images=images, return_tensors="pt")["pixel_values"]
        kwargs = dict(pixel_values=pixels, token_type_ids=(ids == hf_model.config.image_token_id).long())
    logits = hf_model(input_ids=ids, **kwargs).logits[0, :-1]
    lps = torch.log_softmax(logits.float(), -1).gather(1, ids[0, 1:, None])[:, 0].tolist()
    out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                            do_sample=False, min_new_tokens=NEW_TOKENS, **kwargs)
    return out[0, len(token_ids):].tolist(), lps


def _check(llm: LLM, hf_model, prompts: list[dict]) -> None:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens, lps = _hf_reference(hf_model, llm, prompt, out.prompt_token_ids)
        assert out.outputs[0].token_ids == tokens
        ours = [next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]
        assert len(ours) == len(lps)
        assert max(abs(a - b) for a, b in zip(ours, lps)) < 1e-3


@pytest.mark.slow  # ~35 s on two shared cores (HF generates per prompt); the chunk rule has a fast test
def test_gemma3_images_match_hf_in_one_batch(tiny_gemma3):
    path, hf_model = tiny_gemma3
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05)
    prompts = _prompts()
    _check(llm, hf_model, prompts)
    cfg = hf_model.config
    ids = llm.generate(prompts[0], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    # a lone <start_of_image> opened as HF's processor writes an image: "\n\n", start, a token per row, end, "\n\n"
    wrap = llm.get_tokenizer().encode("\n\n", add_special_tokens=False)
    start = ids.index(cfg.boi_token_id)
    image = [cfg.boi_token_id, *[cfg.image_token_id] * IMAGE_TOKENS, cfg.eoi_token_id]
    assert ids[start - len(wrap):start + len(image) + len(wrap)] == [*wrap, *image, *wrap]
    assert llm.engine.runner.multimodal.cache.encoder_runs == 3
    # a chat with an image_url part: the template's <start_of_image>, opened, answered as HF answers the same ids
    image = random_image(50, (70, 90))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(image)}},
                                             {"type": "text", "text": "Describe it."}]}]
    chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    assert chat.prompt_token_ids.count(cfg.image_token_id) == IMAGE_TOKENS
    tokens, _ = _hf_reference(hf_model, llm, {"multi_modal_data": {"image": image}}, chat.prompt_token_ids)
    assert chat.outputs[0].token_ids == tokens


@pytest.mark.slow  # ~40 s, as above
def test_gemma3_chunks_keep_image_runs_whole(tiny_gemma3):
    """Steps of 16 tokens: the first prompt's image run (16 tokens from position 5) would end the first chunk inside
    it; the scheduler ends that chunk before the run and computes the run whole in the next."""
    path, hf_model = tiny_gemma3
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=16, max_num_seqs=4,
              enable_prefix_caching=False)
    prompts = [p for p in _prompts() if "multi_modal_data" in p]
    _, items = llm.engine.process_media(prompts[0], llm.engine.tokenize_prompt(prompts[0])[1])
    assert items[0].offset < 16 < items[0].end  # the budget alone would split the run
    _check(llm, hf_model, prompts)


def test_whole_run_chunk_rules():
    def item(offset, length=16, bidirectional=True):
        return MediaItem("image", "h", offset, length, b"", (0,), bidirectional=bidirectional)
    run = [item(10)]  # tokens 10..25
    assert whole_run_chunk(run, 0, 8, 24) == 8  # ends before the run
    assert whole_run_chunk(run, 0, 20, 24) == 10  # would end inside: cut before it
    assert whole_run_chunk(run, 10, 8, 24) == 16  # starts at it: stretched to its end
    assert whole_run_chunk(run, 10, 8, 12) == 0  # and waits where the step cannot hold it
    assert whole_run_chunk(run, 16, 4, 24) == 10  # after a prefix hit inside it: the rest whole
    assert whole_run_chunk([item(10, bidirectional=False)], 0, 20, 24) == 20  # a causal model's runs split
    assert whole_run_chunk([item(10), item(26)], 0, 30, 40) == 10  # adjacent images are one run (HF's blocks)
    assert whole_run_chunk([item(10), item(26)], 10, 20, 40) == 32


@pytest.mark.slow  # the tiny model's build and load, ~10 s
def test_gemma3_refuses_an_image_longer_than_a_step(tiny_gemma3):
    path, _ = tiny_gemma3
    llm = LLM(path, dtype="float32", kv_cache_memory_gib=0.05, max_num_batched_tokens=12)
    with pytest.raises(ValueError, match="max_num_batched_tokens is 12: raise it to at least 16"):
        llm.generate(_prompts()[0], SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.slow  # three engines on the tiny model, ~15 s
def test_gemma3_checkpoint_names_load_alike(tiny_gemma3, tmp_path):
    """Gemma 3's names as transformers saves them (language_model.model.*, vision_tower.*), as the hub's checkpoints
    give them (the tower under vision_tower.vision_model.*) and as transformers 5 holds them in memory
    (model.language_model.*, model.vision_tower.*, model.multi_modal_projector.*) load to the same model."""
    import shutil

    from safetensors.torch import load_file, save_file
    variants = {"hub": [("vision_tower.", "vision_tower.vision_model.")],
                "in-memory": [("language_model.model.", "model.language_model."),
                              ("vision_tower.", "model.vision_tower."),
                              ("multi_modal_projector.", "model.multi_modal_projector.")]}
    paths = [tiny_gemma3[0]]
    for label, renames in variants.items():
        path = tmp_path / label
        shutil.copytree(tiny_gemma3[0], path)
        tensors = {}
        for name, tensor in load_file(path / "model.safetensors").items():
            old, new = next(((o, n) for o, n in renames if name.startswith(o)), ("", ""))
            tensors[new + name[len(old):]] = tensor
        assert len(tensors) == 80 and any(k.startswith(renames[0][1]) for k in tensors)
        save_file(tensors, path / "model.safetensors")
        paths.append(str(path))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = [LLM(p, dtype="float32", kv_cache_memory_gib=0.02).generate(_prompts()[0], params, use_tqdm=False)[0]
            for p in paths]
    first = [next(iter(lp.values())).logprob for lp in outs[0].outputs[0].logprobs]
    for out in outs[1:]:
        assert out.outputs[0].token_ids == outs[0].outputs[0].token_ids
        assert [next(iter(lp.values())).logprob for lp in out.outputs[0].logprobs] == first
