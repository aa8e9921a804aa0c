"""Images through the engine: LLM.chat's content parts, the encoder cache (the same image in two requests runs
the encoder once), prefix caching keyed by the image (two different images never share KV blocks), placeholder
expansion as HF's processor does it, and the ValueErrors of a bad multimodal prompt."""
from __future__ import annotations

import pytest
from tiny_vl import png_data_url, random_image

from pressroom import LLM, SamplingParams
from pressroom.core.kv_cache_manager import KVCacheManager
from pressroom.core.request import Request
from pressroom.multimodal.inputs import MediaItem
from pressroom.sampling_params import RequestOutputKind

PAD = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def vl_llm(tiny_vl):
    return LLM(tiny_vl[0], dtype="float32", kv_cache_memory_gib=0.05)


def test_chat_image_url_equals_generate(vl_llm):
    image = random_image(7, (80, 120))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(image)}},
                                             {"type": "text", "text": "Describe it."}]}]
    chat = vl_llm.chat(messages, GREEDY, use_tqdm=False)[0]
    prompt = f"<|im_start|>user\n{PAD}Describe it.<|im_end|>\n<|im_start|>assistant\n"
    direct = vl_llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert chat.prompt_token_ids == direct.prompt_token_ids
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    other = vl_llm.generate({"prompt": prompt, "multi_modal_data": {"image": random_image(8, (80, 120))}}, GREEDY,
                            use_tqdm=False)[0]
    assert other.outputs[0].token_ids != direct.outputs[0].token_ids  # the image steers the output


def test_same_image_runs_the_encoder_once_and_different_images_share_no_blocks(vl_llm):
    cache = vl_llm.engine.runner.multimodal.cache
    image, other = random_image(11, (224, 224)), random_image(12, (224, 224))
    prompt = f"Some words first, long enough to fill a block or two of the cache. {PAD} and after."
    runs = cache.encoder_runs
    first = vl_llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    again = vl_llm.generate({"prompt": prompt, "multi_modal_data": {"image": image.copy()}}, GREEDY,
                            use_tqdm=False)[0]
    assert cache.encoder_runs == runs + 1  # the second request read the cached rows
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    block = vl_llm.engine.config.cache.block_size
    image_start = first.prompt_token_ids.index(vl_llm.engine.hf_config.image_token_id)
    assert again.num_cached_tokens > image_start  # the prefix cache reached past the image
    swapped = vl_llm.generate({"prompt": prompt, "multi_modal_data": {"image": other}}, GREEDY, use_tqdm=False)[0]
    assert swapped.num_cached_tokens <= image_start // block * block  # nothing past the image's first block
    assert cache.encoder_runs == runs + 2


def test_media_hash_keys_only_the_blocks_an_image_reaches():
    def request(rid, digest):
        item = MediaItem("image", digest, offset=20, length=8, pixels=b"", pixels_shape=(0,))
        return Request(rid, list(range(64)), GREEDY, None, mm_features=[item])
    kv = KVCacheManager(16, 16)
    a, b = kv._hashes(request("a", "aa"), 4), kv._hashes(request("b", "bb"), 4)
    assert a[0] == b[0]  # the block before the image is shared
    assert a[1] != b[1] and a[2] != b[2] and a[3] != b[3]


def test_placeholders_expand_as_hf_processor(vl_llm):
    """HF's processor repeats the image token per row in the text and tokenizes; the engine expands token ids."""
    engine = vl_llm.engine
    images = [random_image(1, (60, 150)), random_image(2, (112, 112))]
    text = f"Compare {PAD} with {PAD}."
    processed = engine.image_processor().hf(images=images, return_tensors="np")
    text_hf = text
    for grid in processed["image_grid_thw"]:
        text_hf = text_hf.replace("<|image_pad|>", "<|placeholder|>" * (int(grid.prod()) // 4), 1)
    text_hf = text_hf.replace("<|placeholder|>", "<|image_pad|>")
    expected = engine.tokenizer.encode(text_hf, add_special_tokens=False)
    _, ids = engine.tokenize_prompt(text)
    expanded, items = engine.process_media({"multi_modal_data": {"image": images}}, ids)
    assert expanded == expected
    assert [m.offset for m in items] == [i for i, t in enumerate(expected)
                                         if t == engine.hf_config.image_token_id and expected[i - 1] != t]
    again, _ = engine.process_media({"multi_modal_data": {"image": images}}, expanded)  # already expanded: kept
    assert again == expanded


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": f"two {PAD}{PAD}", "multi_modal_data": {"image": [random_image(0, (60, 60))]}},
     "2 image placeholder"),
    ({"prompt": "no placeholder", "multi_modal_data": {"image": random_image(0, (60, 60))}}, "0 image placeholder"),
    ({"prompt": f"{PAD}", "multi_modal_data": {"audio": b"x"}}, "modality audio"),
    ({"prompt": f"{PAD}", "multi_modal_data": {"image": b"not an image"}}, "PIL.Image"),
    ({"prompt": f"{PAD}", "multi_modal_data": [1]}, "must be a dict"),
])
def test_bad_multimodal_prompts_are_value_errors(vl_llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        vl_llm.generate(prompt, GREEDY, use_tqdm=False)
    assert not vl_llm.engine.has_unfinished_requests()


def test_bad_chat_parts_are_value_errors(vl_llm):
    with pytest.raises(ValueError, match="needs a URL"):
        vl_llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError):
        vl_llm.chat([{"role": "user", "content": [{"type": "image_url",
                                                   "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
                    GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="input_audio"):
        vl_llm.chat([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], GREEDY,
                    use_tqdm=False)


def test_limit_mm_per_prompt_offline_as_vllm_spells_it(tiny_vl):
    """LLM(limit_mm_per_prompt=...) caps the items of one prompt per modality (vLLM's constructor argument);
    within the cap the prompt runs."""
    llm = LLM(tiny_vl[0], dtype="float32", kv_cache_memory_gib=0.02, limit_mm_per_prompt={"image": 1})
    two = {"prompt": f"{PAD}{PAD}", "multi_modal_data": {"image": [random_image(0, (60, 60))] * 2}}
    with pytest.raises(ValueError, match=r"At most 1 image.*limit_mm_per_prompt"):
        llm.generate(two, GREEDY, use_tqdm=False)
    one = {"prompt": PAD, "multi_modal_data": {"image": random_image(0, (60, 60))}}
    assert len(llm.generate(one, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == GREEDY.max_tokens
    with pytest.raises(ValueError, match="limit-mm-per-prompt"):
        LLM(tiny_vl[0], dtype="float32", limit_mm_per_prompt={"image": -1})


def test_preprocessed_media_equal_multi_modal_data(vl_llm):
    """The server's way: media processed off the engine's lock (process_media), then added with mm_features."""
    engine = vl_llm.engine
    image = random_image(21, (90, 90))
    prompt = {"prompt": f"Look: {PAD} now", "multi_modal_data": {"image": image}}
    direct = vl_llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    ids, items = engine.process_media(prompt, engine.tokenize_prompt(prompt)[1])
    engine.add_request("pre", {"prompt_token_ids": ids}, GREEDY.clone(output_kind=RequestOutputKind.FINAL_ONLY),
                       mm_features=items)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.finished)
    assert outs[0].outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(ValueError, match="do not match"):
        engine.add_request("bad", {"prompt_token_ids": ids[1:]}, GREEDY, mm_features=items)
    with pytest.raises(ValueError, match="not both"):
        engine.add_request("both", prompt, GREEDY, mm_features=items)


def test_hub_checkpoint_names_load_alike(tiny_vl, vl_llm, tmp_path):
    """The hub's Qwen2.5-VL checkpoints name the decoder model.* and the tower visual.* (transformers 5 saves
    model.language_model.* and model.visual.*): both load to the same model."""
    import shutil

    from safetensors.torch import load_file, save_file
    path = tmp_path / "hub-names"
    shutil.copytree(tiny_vl[0], path)
    tensors = load_file(path / "model.safetensors")
    renamed = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
               for k, v in tensors.items()}
    assert any(k.startswith("visual.") for k in renamed)
    save_file(renamed, path / "model.safetensors")
    prompt = {"prompt": f"{PAD} hub", "multi_modal_data": {"image": random_image(5, (70, 70))}}
    hub = LLM(str(path), dtype="float32", kv_cache_memory_gib=0.02).generate(prompt, GREEDY, use_tqdm=False)[0]
    assert hub.outputs[0].token_ids == vl_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_placeholder_runs_hold_adjacent_or_expanded_images():
    from pressroom.multimodal.processor import _slots
    assert _slots([(3, 2)], [16, 16]) == [(3, 1), (4, 1)]  # LLaVA's <image><image>: one token each
    assert _slots([(3, 32)], [16, 16]) == [(3, 16), (19, 16)]  # already expanded
    assert _slots([(0, 1), (9, 12)], [5, 12]) == [(0, 1), (9, 12)]
    with pytest.raises(ValueError, match="2 image placeholder"):
        _slots([(0, 1), (5, 1)], [4])
    with pytest.raises(ValueError, match="3 image placeholder"):
        _slots([(0, 3)], [16, 16])


def test_media_cross_the_core_process_boundary():
    """A core in its own process gets CoreRequests as msgspec msgpack (engine/core_client.py): media included."""
    import msgspec

    from pressroom.engine.core import CoreRequest
    item = MediaItem("image", "ab12", offset=3, length=4, pixels=b"\x00\x00\x80\x3f" * 6, pixels_shape=(2, 3),
                     grid_thw=(1, 4, 4))
    sent = CoreRequest("r", [1, 2, 3, 9, 9, 9, 9], GREEDY, 0.0, mm_features=[item])
    got = msgspec.msgpack.Decoder(CoreRequest).decode(msgspec.msgpack.Encoder().encode(sent))
    assert got.mm_features == [item]
    assert got.mm_features[0].pixel_tensor().tolist() == [[1.0] * 3] * 2
