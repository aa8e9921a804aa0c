"""A tiny random Qwen2.5-VL checkpoint with its processor: the SmolLM2 tokenizer with Qwen2.5-VL's vision tokens
added, the PIL image processor (no torchvision here) at a small pixel budget, and a chat template that renders
image parts as `<|vision_start|><|image_pad|><|vision_end|>`."""
from __future__ import annotations

import json
from pathlib import Path

import torch

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH, MERGE = 14, 2
# 4..16 merged tokens per image: small enough for fast tests, several window rows and columns per image
MIN_PIXELS, MAX_PIXELS = 4 * (PATCH * MERGE) ** 2, 16 * (PATCH * MERGE) ** 2

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_qwen2_5_vl(path: Path, smollm_tokenizer, seed: int = 0):
    """Saves the checkpoint, tokenizer and processor under `path`; returns the HF model (fp32, eval)."""
    import transformers
    tok = smollm_tokenizer
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    vocab = -(-len(tok) // 64) * 64
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]},
                         rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                           spatial_merge_size=MERGE, temporal_patch_size=2, window_size=56, out_hidden_size=64,
                           fullatt_block_indexes=[1], tokens_per_second=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # larger weights than HF's init, so the vision tower's output moves the logits
        for name, param in model.named_parameters():
            if "visual" in name and param.dim() > 1:
                param.normal_(0, 0.2)
    model.save_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    (Path(path) / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2,
        "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    (Path(path) / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return model


def build_tiny_qwen3_vl(path: Path, smollm_tokenizer, seed: int = 0):
    """A tiny Qwen3-VL (DeepStack after tower blocks 0 and 2, interleaved M-RoPE, a 4x4 position table resized to
    each grid) saved under `path` with its tokenizer and processor; returns the HF model (fp32, eval)."""
    import transformers
    tok = smollm_tokenizer
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    config = transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=-(-len(tok) // 64) * 64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                          "mrope_interleaved": True},
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=16,
                           spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 2]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    model = transformers.Qwen3VLForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" in name and param.dim() > 1:
                param.normal_(0, 0.2)
            elif "norm" in name:  # LayerNorms and q/k norms away from their init
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    model.save_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    side = 16 * MERGE
    (Path(path) / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
        "patch_size": 16, "merge_size": MERGE, "temporal_patch_size": 2,
        "size": {"shortest_edge": 4 * side * side, "longest_edge": 16 * side * side},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    return model


LLAVA_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_llava(path: Path, smollm_tokenizer, seed: int = 0):
    """A tiny LLaVA: a CLIP tower (32x32 images, 8x8 patches: 16 rows an image after the class token is
    dropped, features from its second-to-last layer) and a Llama decoder, with the `<image>` token and CLIP's
    PIL image processor; returns the HF model (fp32, eval)."""
    import transformers
    tok = smollm_tokenizer
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                                    num_attention_heads=2, image_size=32, patch_size=8),
        text_config=transformers.LlamaConfig(vocab_size=-(-len(tok) // 64) * 64, hidden_size=64,
                                             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, max_position_embeddings=512,
                                             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        vision_feature_select_strategy="default", projector_hidden_act="gelu", image_seq_length=16)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("vision_tower" in name or "projector" in name) and param.dim() > 1:
                param.normal_(0, 0.2)
    model.save_pretrained(path)
    tok.chat_template = LLAVA_TEMPLATE
    tok.save_pretrained(path)
    (Path(path) / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": 32},
        "do_center_crop": True, "crop_size": {"height": 32, "width": 32}, "do_normalize": True, "resample": 3,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    return model


def random_image(seed: int, size: tuple[int, int]):
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png_data_url(image) -> str:
    """The image as a PNG data URL (what a client sends as an image_url part)."""
    import base64
    import io
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
