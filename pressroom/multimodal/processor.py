"""A prompt's images turned into what the model runner needs: the image processor's patches (HF's PIL-based
processors: torchvision, which the fast ones need, does not load against this torch build) and the prompt's
placeholder tokens expanded to one per encoder output row.

Placeholders are expanded on token ids, not text: a text prompt is tokenized first (the image token is a special
token, so the ids are those HF's processor gets by expanding the text), and a token prompt (vLLM's
`prompt_token_ids` with `multi_modal_data`) is expanded alike. A run of placeholders already as long as the
image's output (a prompt HF's processor expanded) is kept as it is.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from pressroom.multimodal.inputs import MediaItem
from pressroom.multimodal.media import DEFAULT_LIMIT_PER_PROMPT

# The families pressroom serves images to; each prompt holds an image as one image token per encoder output row.
_QWEN_VL_TYPES = {"qwen2_5_vl", "qwen3_vl"}  # dynamic resolution: rows from the processor's grid
_LLAVA_TYPES = {"llava"}  # a fixed-size tower (CLIP or SigLIP) and a projector: rows from the patch count
_CLS_TOWERS = {"clip_vision_model"}  # towers whose output starts with a class token


@dataclass(frozen=True, slots=True)
class PlaceholderLayout:
    """Where a family's prompt puts an image: `token_id` repeated once per encoder output row, of which an image
    has (patches / merge_size^2 + extra_rows)."""
    token_id: int
    merge_size: int = 1  # patches merged per output row along each side (Qwen-VL)
    patch_size: int = 0  # pixels per patch side where the processor gives no grid (LLaVA)
    extra_rows: int = 0  # a class token kept (+1) or a patch dropped (-1), LLaVA's feature selection

    def rows(self, grid: tuple[int, int, int]) -> int:
        return int(np.prod(grid)) // self.merge_size ** 2 + self.extra_rows


def supports_images(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", "") in _QWEN_VL_TYPES | _LLAVA_TYPES


def placeholder_layout(hf_config: Any) -> PlaceholderLayout:
    if hf_config.model_type in _QWEN_VL_TYPES:
        merge = int(hf_config.vision_config.spatial_merge_size)
        return PlaceholderLayout(int(hf_config.image_token_id), merge_size=merge)
    vision = hf_config.vision_config
    cls = 1 if getattr(vision, "model_type", "") in _CLS_TOWERS else 0
    drop = 1 if getattr(hf_config, "vision_feature_select_strategy", "default") == "default" else 0
    return PlaceholderLayout(int(hf_config.image_token_index), patch_size=int(vision.patch_size), extra_rows=cls - drop)


class ImageProcessor:
    """The model folder's image processor and its placeholder layout."""

    def __init__(self, model_path: str, hf_config: Any, max_images: int = DEFAULT_LIMIT_PER_PROMPT) -> None:
        if not supports_images(hf_config):
            raise ValueError(f"This model ({getattr(hf_config, 'model_type', '?')}) takes no images; "
                             f"image inputs need one of: {', '.join(sorted(_QWEN_VL_TYPES | _LLAVA_TYPES))}.")
        self.hf = load_pil_image_processor(model_path)
        self.layout = placeholder_layout(hf_config)
        self.max_images = max_images
        self._fingerprint = repr(sorted((k, repr(v)) for k, v in self.hf.to_dict().items())).encode()

    def process(self, token_ids: list[int], images: list[Any]) -> tuple[list[int], list[MediaItem]]:
        """The prompt with each image's placeholder expanded, and the images as MediaItems in prompt order."""
        if len(images) > self.max_images:
            raise ValueError(f"At most {self.max_images} images per prompt (limit_mm_per_prompt); got {len(images)}.")
        runs = placeholder_runs(token_ids, self.layout.token_id)
        if sum(run for _, run in runs) < len(images):  # before the costly processing
            raise ValueError(f"The prompt has {sum(run for _, run in runs)} image placeholder(s) but {len(images)} "
                             "image(s) were given; put one image token per image where it goes (the chat template "
                             "does this).")
        encoded = [self._encode(image) for image in images]
        rows = [self.layout.rows(grid) for _, grid, _ in encoded]
        out, items, copied = [], [], 0
        for (start, run), (pixels, grid, digest), n in zip(_slots(runs, rows), encoded, rows):
            out.extend(token_ids[copied:start])
            items.append(MediaItem("image", digest, len(out), n, pixels.tobytes(), tuple(pixels.shape),
                                   str(pixels.dtype), tuple(int(g) for g in grid)))
            out.extend([self.layout.token_id] * n)
            copied = start + run
        out.extend(token_ids[copied:])
        return out, items

    def _encode(self, image: Any) -> tuple[np.ndarray, tuple[int, int, int], str]:
        image = _as_rgb(image)
        batch = self.hf(images=[image], return_tensors="np")
        pixels = np.ascontiguousarray(batch["pixel_values"], dtype=np.float32)
        if "image_grid_thw" in batch:
            grid = tuple(int(g) for g in batch["image_grid_thw"][0])
        else:  # a fixed-size tower: [1, channels, height, width]
            patch = self.layout.patch_size
            grid = (1, pixels.shape[-2] // patch, pixels.shape[-1] // patch)
        return pixels, grid, self._hash(image)

    def _hash(self, image) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(self._fingerprint)
        h.update(f"{image.mode}:{image.size}".encode())
        h.update(image.tobytes())
        return h.hexdigest()


def load_pil_image_processor(model_path: str):
    """The folder's image processor, its PIL implementation (no torchvision needed): transformers 5 names it by
    `backend`, 4.x by `use_fast=False`."""
    import transformers
    try:
        from transformers import AutoImageProcessor
    except (ImportError, RuntimeError) as e:  # a torchvision built for another torch breaks transformers' imports
        raise ValueError(f"transformers cannot load its image processors ({e}); a torchvision that does not match "
                         "this torch build is the usual cause: uninstall it (pressroom uses the PIL "
                         "processors).") from e
    if int(transformers.__version__.split(".")[0]) >= 5:
        processor = AutoImageProcessor.from_pretrained(model_path, backend="pil")
    else:
        processor = AutoImageProcessor.from_pretrained(model_path, use_fast=False)
    if getattr(processor, "is_fast", False):
        raise ValueError(f"{type(processor).__name__} is torchvision-based; pressroom needs the PIL image processor.")
    return processor


def placeholder_runs(token_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token_id`."""
    runs, i, n = [], 0, len(token_ids)
    while i < n:
        if token_ids[i] == token_id:
            j = i
            while j < n and token_ids[j] == token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def _slots(runs: list[tuple[int, int]], rows: list[int]) -> list[tuple[int, int]]:
    """(start, tokens) each image takes in the prompt. A run of placeholders holds either one token per image
    (adjacent images, as LLaVA's `<image><image>`) or images already expanded (its length their rows' sum)."""
    slots, i = [], 0
    for start, run in runs:
        j, total = i, 0
        while j < len(rows) and total < run:
            total, j = total + rows[j], j + 1
        if total == run:  # expanded (or images of one row each)
            for k in range(i, j):
                slots.append((start + sum(rows[i:k]), rows[k]))
            i = j
        elif i + run <= len(rows):
            slots.extend((start + k, 1) for k in range(run))
            i += run
        else:
            break
    else:
        if i == len(rows):
            return slots
    raise ValueError(f"The prompt has {sum(run for _, run in runs)} image placeholder(s) but {len(rows)} image(s) "
                     "were given; put one image token per image where it goes (the chat template does this).")


def _as_rgb(image: Any):
    from PIL import Image
    if not isinstance(image, Image.Image):
        raise ValueError(f"An image must be a PIL.Image; got {type(image).__name__}.")
    return image if image.mode == "RGB" else image.convert("RGB")
