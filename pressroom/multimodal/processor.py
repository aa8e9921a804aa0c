"""A prompt's media turned into what the model runner needs: each item's processor output (images: HF's PIL-based
image processors, since torchvision, which the fast ones need, does not load against this torch build; audio:
HF's WhisperFeatureExtractor's log-mel frames) and the prompt's placeholder tokens expanded to one per encoder
output row.

`placeholder_layouts` is the one place that says, per model family, which modalities it takes and how its prompt
holds each item (its placeholder token and how many rows an item becomes). Placeholders are expanded on token ids,
not text: a text prompt is tokenized first (the placeholder is a special token, so the ids are those HF's processor
gets by expanding the text), and a token prompt (vLLM's `prompt_token_ids` with `multi_modal_data`) is expanded
alike. A run of placeholders already as long as the item's rows (a prompt HF's processor expanded) is kept as it is.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pressroom.multimodal.inputs import MediaItem
from pressroom.multimodal.media import DEFAULT_LIMIT_PER_PROMPT, MAX_SAMPLE_RATE, MediaPolicy

# The families pressroom serves media to; each prompt holds an item as one placeholder token per encoder output row.
_QWEN_VL_TYPES = {"qwen2_5_vl", "qwen3_vl"}  # dynamic resolution: rows from the processor's grid
# videos as temporal patches of frames: Qwen2.5-VL's one run of placeholders a video, Qwen3-VL's one run a temporal
# patch, each after its timestamp text
_QWEN_VIDEO_TYPES = {"qwen2_5_vl", "qwen3_vl"}
_FRAMES_IN_BUDGET = {"qwen3_vl"}  # the video processor's pixel budget bounds all frames together, not each
_LLAVA_TYPES = {"llava"}  # a fixed-size tower (CLIP or SigLIP) and a projector: rows from the patch count
_GEMMA3_TYPES = {"gemma3"}  # SigLIP pooled to mm_tokens_per_image rows; image tokens attend bidirectionally
_QWEN_AUDIO_TYPES = {"qwen2_audio"}  # Whisper's encoder, 2x pooled: rows from the clip's mel frames
_CLS_TOWERS = {"clip_vision_model"}  # towers whose output starts with a class token


@dataclass(frozen=True, slots=True)
class PlaceholderLayout:
    """Where a family's prompt puts an image: `token_id` repeated once per encoder output row, of which an image
    has (patches / merge_size^2 + extra_rows)."""
    token_id: int
    merge_size: int = 1  # patches merged per output row along each side (Qwen-VL)
    patch_size: int = 0  # pixels per patch side where the processor gives no grid (LLaVA)
    extra_rows: int = 0  # a class token kept (+1) or a patch dropped (-1), LLaVA's feature selection
    # Gemma 3: a lone `start_id` (<start_of_image>, what its chat template writes) stands for an image and becomes
    # start, the placeholders, `end_id`; the run is attended bidirectionally (MediaItem.bidirectional)
    start_id: int = -1
    end_id: int = -1
    bidirectional: bool = False
    wrap: str = ""  # text HF's processor puts before the start token and after the end token (Gemma 3's "\n\n")
    # Qwen3-VL's video: each temporal patch its own run, written `<{seconds:.1f} seconds>`, frame_start_id, the
    # run, frame_end_id (the prompt's wrapper around the video's one placeholder is dropped, as HF's processor does)
    frame_start_id: int = -1
    frame_end_id: int = -1

    def rows(self, grid: tuple[int, int, int]) -> int:
        return int(np.prod(grid)) // self.merge_size ** 2 + self.extra_rows


@dataclass(frozen=True, slots=True)
class AudioLayout:
    """Where a family's prompt puts an audio clip: `token_id` once per encoder output row; a clip of F mel frames
    has ceil(F / 2) rows after the encoder's stride-2 convolution, halved again by an average pool (`pooled`)."""
    token_id: int
    pooled: bool = True

    def rows(self, grid: tuple[int, int, int]) -> int:
        from pressroom.multimodal.audio_features import conv_frames, pooled_frames
        frames = grid[-1]
        return pooled_frames(frames) if self.pooled else conv_frames(frames)


Layout = PlaceholderLayout | AudioLayout


def placeholder_layouts(hf_config: Any) -> dict[str, Layout]:
    """The modalities a model takes, each with its prompt layout ({} for a text-only model). A new family's
    placeholder rule goes here."""
    kind = getattr(hf_config, "model_type", "")
    if kind in _QWEN_VL_TYPES:
        merge = int(hf_config.vision_config.spatial_merge_size)
        layouts = {"image": PlaceholderLayout(int(hf_config.image_token_id), merge_size=merge)}
        if kind in _QWEN_VIDEO_TYPES:
            framed = kind == "qwen3_vl"
            layouts["video"] = PlaceholderLayout(
                int(hf_config.video_token_id), merge_size=merge,
                frame_start_id=int(hf_config.vision_start_token_id) if framed else -1,
                frame_end_id=int(hf_config.vision_end_token_id) if framed else -1)
        return layouts
    if kind in _LLAVA_TYPES:
        vision = hf_config.vision_config
        cls = 1 if getattr(vision, "model_type", "") in _CLS_TOWERS else 0
        drop = 1 if getattr(hf_config, "vision_feature_select_strategy", "default") == "default" else 0
        return {"image": PlaceholderLayout(int(hf_config.image_token_index), patch_size=int(vision.patch_size),
                                           extra_rows=cls - drop)}
    if kind in _GEMMA3_TYPES:  # a fixed-size image pooled to a square of rows: one "patch" per pooled row
        side = int(hf_config.mm_tokens_per_image ** 0.5)
        return {"image": PlaceholderLayout(int(hf_config.image_token_id), patch_size=hf_config.vision_config.image_size
                                           // side, start_id=int(hf_config.boi_token_id),
                                           end_id=int(hf_config.eoi_token_id), bidirectional=True, wrap="\n\n")}
    if kind in _QWEN_AUDIO_TYPES:
        return {"audio": AudioLayout(int(hf_config.audio_token_index))}
    return {}


def supported_modalities(hf_config: Any) -> frozenset[str]:
    return frozenset(placeholder_layouts(hf_config))


def supports_images(hf_config: Any) -> bool:
    return "image" in supported_modalities(hf_config)


def placeholder_layout(hf_config: Any) -> PlaceholderLayout:
    """The model's image layout."""
    return placeholder_layouts(hf_config)["image"]


def _media_families() -> str:
    return ", ".join(sorted(_QWEN_VL_TYPES | _LLAVA_TYPES | _GEMMA3_TYPES | _QWEN_AUDIO_TYPES))


@dataclass(frozen=True, slots=True)
class Encoded:
    """One item after its processor: the encoder's input, its grid and its content hash."""
    payload: np.ndarray
    grid: tuple[int, int, int]
    hash: str
    seconds_per_grid: float = 0.0  # a video's seconds per temporal patch
    timestamps: tuple[float, ...] = ()  # a video's time of each temporal patch (Qwen3-VL's prompt text)


class ImageProcessor:
    """The model folder's image processor and its placeholder layout."""
    modality = "image"

    def __init__(self, model_path: str, hf_config: Any) -> None:
        if not supports_images(hf_config):
            families = ", ".join(sorted(_QWEN_VL_TYPES | _LLAVA_TYPES | _GEMMA3_TYPES))
            raise ValueError(f"This model ({getattr(hf_config, 'model_type', '?')}) takes no images; "
                             f"image inputs need one of: {families}.")
        self.hf = load_pil_image_processor(model_path)
        self.layout = placeholder_layout(hf_config)
        self._fingerprint = repr(sorted((k, repr(v)) for k, v in self.hf.to_dict().items())).encode()

    def encode(self, image: Any) -> Encoded:
        image = _as_rgb(image)
        batch = self.hf(images=[image], return_tensors="np")
        pixels = np.ascontiguousarray(batch["pixel_values"], dtype=np.float32)
        if "image_grid_thw" in batch:
            grid = tuple(int(g) for g in batch["image_grid_thw"][0])
        else:  # a fixed-size tower: [1, channels, height, width]
            patch = self.layout.patch_size
            grid = (1, pixels.shape[-2] // patch, pixels.shape[-1] // patch)
        h = hashlib.blake2b(self._fingerprint, digest_size=16)
        h.update(f"{image.mode}:{image.size}".encode())
        h.update(image.tobytes())
        return Encoded(pixels, grid, h.hexdigest())


class AudioProcessor:
    """The model folder's Whisper feature extractor and the audio placeholder layout. A clip is vLLM's
    `(samples, sample_rate)` (or bare samples at the extractor's rate): mono, resampled to 16 kHz, cut to the
    extractor's 30-second window as HF's processor cuts it. Its MediaItem holds the log-mel frames the encoder reads
    (the clip's own and the two its convolutions read past them) and grid (1, 1, the clip's frames)."""
    modality = "audio"

    def __init__(self, model_path: str, hf_config: Any) -> None:
        from pressroom.multimodal.audio_features import WhisperFeatures
        layout = placeholder_layouts(hf_config).get("audio")
        if layout is None:
            raise ValueError(f"This model ({getattr(hf_config, 'model_type', '?')}) takes no audio; audio inputs "
                             f"need one of: {', '.join(sorted(_QWEN_AUDIO_TYPES))}.")
        self.layout = layout
        self.features = WhisperFeatures(model_path)
        self._fingerprint = self.features.fingerprint()

    def encode(self, clip: Any) -> Encoded:
        from pressroom.multimodal.audio_features import crop_frames
        samples = self.samples(clip)
        mel = self.features(samples)
        if self.layout.rows((1, 1, mel.frames)) < 1:
            raise ValueError(f"An audio clip of {samples.size} samples is too short to encode; give at least "
                             f"{4 * self.features.hf.hop_length} samples at {self.features.sampling_rate} Hz.")
        payload = np.ascontiguousarray(mel.features[:, :crop_frames(mel.frames, mel.features.shape[-1])])
        h = hashlib.blake2b(self._fingerprint, digest_size=16)
        h.update(samples.tobytes())
        return Encoded(payload, (1, 1, mel.frames), h.hexdigest())

    def samples(self, clip: Any) -> np.ndarray:
        """A clip as mono float32 samples at the extractor's rate, at most one window long."""
        from pressroom.multimodal.audio_features import resample
        target = self.features.sampling_rate
        samples, rate = _clip_parts(clip, target)
        # the window at the clip's rate and the resampler filter's reach past it (a tiny rate's costs no more)
        keep = -(-self.features.max_samples * rate // target) + 32 * max(1, rate // target)
        samples = np.asarray(samples[:keep], dtype=np.float32)  # cut first: a long clip costs no more than 30 s
        if not np.isfinite(samples).all():
            raise ValueError("Audio samples must be finite (no NaN or infinity).")
        return resample(samples, rate, target)[:self.features.max_samples]  # the filter saw past the window's end


class VideoProcessor:
    """Qwen-VL's video processing, in numpy and PIL (HF's video processors need torchvision, which does not load
    here): every given frame kept (HF's `do_sample_frames` off; the server samples a URL's frames when it decodes
    them), each resized to one dynamic-resolution size, rescaled and normalized, the frames padded to a whole
    number of temporal patches by repeating the last, and cut into [t * h * w, C * temporal * patch * patch]
    patches in the vision tower's merge-block order. The settings are the folder's video_preprocessor_config.json
    (else its preprocessor_config.json, as HF falls back), with HF's Qwen2-VL or Qwen3-VL video defaults (Qwen3-VL's
    pixel budget bounds all frames together). Each temporal patch's time, for Qwen3-VL's timestamps, is the mean
    of its first and last frame's (frame index / the video's fps).

    A video is vLLM's item: frames [T, H, W, 3] uint8 (an array, a tensor or a list of PIL images), or
    `(frames, metadata)` with metadata's `fps` (and `frames_indices` / `total_num_frames` where the frames were
    sampled). Its seconds per temporal patch are temporal_patch_size / sampled fps, where frames without metadata
    count as 24 fps (HF's default)."""
    modality = "video"
    DEFAULT_FPS = 24.0  # HF's VideoMetadata.sampled_fps without an fps

    def __init__(self, model_path: str, hf_config: Any) -> None:
        layout = placeholder_layouts(hf_config).get("video")
        if layout is None:
            raise ValueError(f"This model ({getattr(hf_config, 'model_type', '?')}) takes no video; video inputs "
                             f"need one of: {', '.join(sorted(_QWEN_VIDEO_TYPES))}.")
        self.layout = layout
        self.settings = VideoSettings.from_folder(model_path, getattr(hf_config, "model_type", ""))
        self._fingerprint = repr(self.settings).encode()

    def encode(self, video: Any) -> Encoded:
        frames, fps, indices, video_fps = _video_parts(video)
        s = self.settings
        policy = MediaPolicy()
        if frames.shape[0] > policy.max_frames or frames[..., 0].size > policy.max_image_pixels:
            raise ValueError(f"A video of {frames.shape[0]} frames of {frames.shape[2]}x{frames.shape[1]} is past the "
                             f"limits ({policy.max_frames} frames, {policy.max_image_pixels} pixels in all); "
                             f"sample fewer frames.")
        count = max(frames.shape[0], s.temporal_patch_size) if s.frames_in_budget else 1
        height, width = qwen_smart_resize(frames.shape[1], frames.shape[2], s.patch_size * s.merge_size,
                                          s.min_pixels, s.max_pixels, count, s.temporal_patch_size)
        pixels = np.stack([_resized(f, width, height, s.resample) for f in frames]).astype(np.float32)
        pixels = (pixels * np.float32(s.rescale_factor) - np.asarray(s.image_mean, np.float32)) \
            / np.asarray(s.image_std, np.float32)
        payload, grid = _video_patches(pixels.transpose(0, 3, 1, 2), s.patch_size, s.merge_size,
                                       s.temporal_patch_size)
        h = hashlib.blake2b(self._fingerprint, digest_size=16)
        h.update(f"{frames.shape}:{fps!r}:{video_fps!r}:{indices}".encode())
        h.update(np.ascontiguousarray(frames).tobytes())
        return Encoded(payload, grid, h.hexdigest(), seconds_per_grid=s.temporal_patch_size / fps,
                       timestamps=patch_times(indices, video_fps, s.temporal_patch_size))


def patch_times(indices: list[int], fps: float, temporal: int) -> tuple[float, ...]:
    """Each temporal patch's time in seconds: the mean of its first and last frame's (the last frame repeated to
    fill the final patch), as HF's Qwen3-VL processor writes them."""
    indices = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    seconds = [i / fps for i in indices]
    return tuple((seconds[i] + seconds[i + temporal - 1]) / 2 for i in range(0, len(seconds), temporal))


@dataclass(frozen=True, slots=True)
class VideoSettings:
    """A Qwen-VL video processor's settings (HF's Qwen2VLVideoProcessor defaults; Qwen3-VL's: QWEN3_VIDEO_DEFAULTS)."""
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 28 * 28 * 768
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    resample: int = 3  # PIL's bicubic
    frames_in_budget: bool = False  # min/max pixels bound all frames together (Qwen3-VL)

    @classmethod
    def from_folder(cls, model_path: str, model_type: str = "") -> VideoSettings:
        import json
        from pathlib import Path
        found = {}
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if (Path(model_path) / name).is_file():
                found = json.loads((Path(model_path) / name).read_text())
                break
        size = found.get("size") or {}
        kept = {k: found[k] for k in ("patch_size", "merge_size", "temporal_patch_size", "rescale_factor",
                                      "resample") if found.get(k) is not None}
        kept.update({k: tuple(found[k]) for k in ("image_mean", "image_std") if found.get(k) is not None})
        smallest = found.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
        largest = found.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
        kept.update({k: int(v) for k, v in (("min_pixels", smallest), ("max_pixels", largest)) if v})
        base = QWEN3_VIDEO_DEFAULTS if model_type in _FRAMES_IN_BUDGET else {}
        return cls(**{**base, **kept})


# HF's Qwen3VLVideoProcessor defaults where they differ from Qwen2-VL's
QWEN3_VIDEO_DEFAULTS = {"patch_size": 16, "min_pixels": 128 * 32 * 32, "max_pixels": 32 * 32 * 768,
                        "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5), "frames_in_budget": True}


def qwen_smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int = 1,
                      temporal: int = 1) -> tuple[int, int]:
    """Qwen-VL's dynamic resolution: each side a multiple of `factor`, the area (of `frames` frames, Qwen3-VL's
    video budget, rounded to whole temporal patches) within [min_pixels, max_pixels], the aspect ratio kept as
    closely as that allows."""
    if frames > 1 and (height < factor or width < factor):  # Qwen3-VL's: a side under one factor scaled up first
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"A frame's aspect ratio must be under 200; got {width}x{height}.")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(frames / temporal) * temporal if frames > 1 else 1
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor)
                                                                             * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _resized(frame: np.ndarray, width: int, height: int, resample: int) -> np.ndarray:
    from PIL import Image
    if frame.shape[:2] == (height, width):
        return frame
    return np.asarray(Image.fromarray(frame).resize((width, height), resample=resample))


def _video_patches(frames: np.ndarray, patch: int, merge: int, temporal: int
                   ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """frames [T, C, H, W] -> ([t * h * w, C * temporal * patch * patch] patches, (t, h, w)): frames padded to a
    whole temporal patch with the last, patches in merge-block order (the vision tower's)."""
    if pad := -frames.shape[0] % temporal:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    count, channels, height, width = frames.shape
    t, h, w = count // temporal, height // patch, width // patch
    patches = frames.reshape(t, temporal, channels, h // merge, merge, patch, w // merge, merge, patch)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, block row, block col, row, col, C, temporal, y, x
    return np.ascontiguousarray(patches.reshape(t * h * w, -1), dtype=np.float32), (t, h, w)


def _video_parts(video: Any) -> tuple[np.ndarray, float, list[int], float]:
    """vLLM's video item as (frames [T, H, W, 3] uint8, the frames' sampled fps, their indices in the video, the
    video's fps)."""
    metadata = None
    if isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], Mapping):
        video, metadata = video
    if hasattr(video, "detach"):  # a torch tensor
        video = video.detach().cpu().numpy()
    if isinstance(video, list) and video and not isinstance(video[0], np.ndarray):
        video = np.stack([np.asarray(_as_rgb(f)) for f in video])
    elif isinstance(video, list) and video:
        video = np.stack(video)
    if not isinstance(video, np.ndarray) or video.ndim != 4 or video.shape[-1] != 3 or not video.shape[0] \
            or min(video.shape[1:3]) < 1:
        shape = getattr(video, "shape", None)
        raise ValueError("A video must be its frames, [frames, height, width, 3] RGB uint8 (an array, a tensor or a "
                         f"list of PIL images), or (frames, metadata); got {type(video).__name__}"
                         f"{f' of shape {tuple(shape)}' if shape is not None else ''}.")
    if video.dtype != np.uint8:
        if video.dtype.kind == "f" or video.min() < 0 or video.max() > 255:
            raise ValueError(f"Video frames must be uint8 RGB in 0..255; got {video.dtype}.")
        video = video.astype(np.uint8)
    indices = list((metadata or {}).get("frames_indices") or range(video.shape[0]))
    if len(indices) != video.shape[0]:
        raise ValueError(f"A video's metadata frames_indices must name each of its {video.shape[0]} frames; got "
                         f"{len(indices)}.")
    sampled = _sampled_fps(metadata)  # the fps checked first
    return video, sampled, [int(i) for i in indices], float((metadata or {}).get("fps") or VideoProcessor.DEFAULT_FPS)


def _sampled_fps(metadata: Mapping[str, Any] | None) -> float:
    """HF's VideoMetadata.sampled_fps: the fps of the frames kept (24 where the video's fps is not given)."""
    metadata = metadata or {}
    fps, indices, total = metadata.get("fps"), metadata.get("frames_indices"), metadata.get("total_num_frames")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < 1e4):
        raise ValueError(f"A video's metadata fps must be a number of frames per second above 0; got {fps!r}.")
    if fps is None or indices is None or not total:
        return float(fps or VideoProcessor.DEFAULT_FPS)
    return len(indices) / total * fps


class MediaProcessor:
    """A model's processors, one per modality it takes (each made at its first item), and the placeholder
    expansion over all of a prompt's items."""

    def __init__(self, model_path: str, hf_config: Any,
                 limits: Mapping[str, int] | None = None, tokenizer: Any = None) -> None:
        """`tokenizer`: the model's, for a layout's wrap text (without one, none is added)."""
        self.layouts = placeholder_layouts(hf_config)
        if not self.layouts:
            raise ValueError(f"multi_modal_data: this model ({getattr(hf_config, 'model_type', '?')}) takes text "
                             f"only; media inputs need one of: {_media_families()}.")
        self.model_path, self.hf_config = model_path, hf_config
        self.limits = dict(limits or {})
        self.tokenizer = tokenizer
        self._processors: dict[str, ImageProcessor | AudioProcessor | VideoProcessor] = {}
        self._split_ids: frozenset[int] | None = None  # the tokenizer's added tokens (text splits at them)

    def processor(self, modality: str) -> ImageProcessor | AudioProcessor | VideoProcessor:
        if modality not in self._processors:
            if modality not in self.layouts:
                takes = ", ".join(sorted(self.layouts))
                raise ValueError(f"multi_modal_data modality {modality} is not supported by this model "
                                 f"({getattr(self.hf_config, 'model_type', '?')}); it takes {takes} and text.")
            make = {"image": ImageProcessor, "audio": AudioProcessor, "video": VideoProcessor}[modality]
            self._processors[modality] = make(self.model_path, self.hf_config)
        return self._processors[modality]

    def _wrap_ids(self, layout: Layout) -> list[int]:
        text = getattr(layout, "wrap", "")
        return self.tokenizer.encode(text, add_special_tokens=False) if text and self.tokenizer is not None else []

    def token_id(self, modality: str) -> int:
        return self.layouts[modality].token_id

    def process(self, token_ids: list[int], media: Mapping[str, list[Any]]) -> tuple[list[int], list[MediaItem]]:
        """The prompt with each item's placeholder expanded, and the items as MediaItems in prompt order."""
        media = {modality: values for modality, values in media.items() if values}
        for modality in media:  # every modality's tokens opened before any slot is placed (slots index the ids)
            layout = self.processor(modality).layout
            token_ids = _open_starts(token_ids, layout, self._wrap_ids(layout))
        slots: list[tuple[int, int, str, Encoded, int]] = []  # (start, tokens taken, modality, item, rows)
        for modality, values in media.items():
            processor = self.processor(modality)
            limit = self.limits.get(modality, DEFAULT_LIMIT_PER_PROMPT)
            if len(values) > limit:
                raise ValueError(f"At most {limit} {modality} item(s) per prompt (limit_mm_per_prompt); "
                                 f"got {len(values)}.")
            runs = placeholder_runs(token_ids, processor.layout.token_id)
            if sum(run for _, run in runs) < len(values):  # before the costly processing
                raise _count_error(modality, sum(run for _, run in runs), len(values))
            encoded = [processor.encode(v) for v in values]
            rows = [processor.layout.rows(e.grid) for e in encoded]
            slots.extend((start, taken, modality, e, n)
                         for (start, taken), e, n in zip(_slots(runs, rows, modality), encoded, rows))
        return _expand(token_ids, sorted(slots, key=lambda s: s[0]), self.layouts, self._timestamp_ids)

    def _timestamp_ids(self, seconds: float, before: list[int]) -> tuple[int, list[int]]:
        """A Qwen3-VL frame's timestamp text as token ids, tokenized as HF's processor does, within the text it
        follows: returns (where that text starts in `before`, its ids and the timestamp's). The text since the last
        added (special) token is re-tokenized with it (a BPE merges across the join: "\n<" is one token)."""
        if self.tokenizer is None:
            raise ValueError("Qwen3-VL's videos need the model's tokenizer for their frames' timestamps.")
        if self._split_ids is None:
            self._split_ids = frozenset(getattr(self.tokenizer, "added_tokens_decoder", {})) | frozenset(
                getattr(self.tokenizer, "all_special_ids", ()))
        start = len(before)
        while start > 0 and before[start - 1] not in self._split_ids:
            start -= 1
        text = self.tokenizer.decode(before[start:]) if start < len(before) else ""
        return start, self.tokenizer.encode(f"{text}<{seconds:.1f} seconds>", add_special_tokens=False)


def _expand(token_ids: list[int], slots: list[tuple[int, int, str, Encoded, int]], layouts: dict[str, Layout],
            timestamp_ids: Any = None) -> tuple[list[int], list[MediaItem]]:
    out, items, copied = [], [], 0
    for start, taken, modality, e, n in slots:
        out.extend(token_ids[copied:start])
        layout = layouts[modality]
        if getattr(layout, "frame_start_id", -1) >= 0:
            copied = _expand_frames(out, items, token_ids, start, taken, modality, e, layout, timestamp_ids)
            continue
        items.append(MediaItem(modality, e.hash, len(out), n, e.payload.tobytes(), tuple(e.payload.shape),
                               str(e.payload.dtype), e.grid, getattr(layouts[modality], "bidirectional", False),
                               e.seconds_per_grid))
        out.extend([layouts[modality].token_id] * n)
        copied = start + taken
    out.extend(token_ids[copied:])
    return out, items


def _expand_frames(out: list[int], items: list[MediaItem], token_ids: list[int], start: int, taken: int,
                   modality: str, e: Encoded, layout: PlaceholderLayout, timestamp_ids: Any) -> int:
    """Qwen3-VL's video: the placeholder's wrapper dropped, then per temporal patch its timestamp, start, its rows
    (an item of its own, grid (1, h, w): the tower attends within a frame, so a patch encodes alone as it does
    in the whole) and end. Returns where copying the prompt goes on."""
    end = start + taken
    if out and out[-1] == layout.frame_start_id and end < len(token_ids) and token_ids[end] == layout.frame_end_id:
        out.pop()
        end += 1
    t, h, w = e.grid
    rows = h * w // layout.merge_size ** 2
    for i, seconds in enumerate(e.timestamps[:t]):
        text_start, ids = timestamp_ids(seconds, out)
        out[text_start:] = ids
        out.append(layout.frame_start_id)
        payload = e.payload[i * h * w:(i + 1) * h * w]
        items.append(MediaItem(modality, f"{e.hash}:{i}", len(out), rows, payload.tobytes(), tuple(payload.shape),
                               str(payload.dtype), (1, h, w), False, e.seconds_per_grid))
        out.extend([layout.token_id] * rows)
        out.append(layout.frame_end_id)
    return end


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


def _open_starts(token_ids: list[int], layout: Layout, wrap: list[int]) -> list[int]:
    """Each lone start token (not followed by a placeholder) as HF's processor writes an image: the wrap, start, one
    placeholder, end, the wrap (Gemma 3)."""
    start = getattr(layout, "start_id", -1)
    if start < 0 or start not in token_ids:
        return token_ids
    out = []
    for i, t in enumerate(token_ids):
        if t == start and (i + 1 == len(token_ids) or token_ids[i + 1] != layout.token_id):
            out += [*wrap, start, layout.token_id, layout.end_id, *wrap]
        else:
            out.append(t)
    return out


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


def _slots(runs: list[tuple[int, int]], rows: list[int], modality: str = "image") -> list[tuple[int, int]]:
    """(start, tokens) each item takes in the prompt. A run of placeholders holds either one token per item
    (adjacent items, as LLaVA's `<image><image>`) or items already expanded (its length their rows' sum)."""
    slots, i = [], 0
    for start, run in runs:
        j, total = i, 0
        while j < len(rows) and total < run:
            total, j = total + rows[j], j + 1
        if total == run:  # expanded (or items of one row each)
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
    raise _count_error(modality, sum(run for _, run in runs), len(rows))


def _count_error(modality: str, placeholders: int, items: int) -> ValueError:
    noun = "image(s)" if modality == "image" else f"{modality} clip(s)" if modality == "audio" else f"{modality}(s)"
    return ValueError(f"The prompt has {placeholders} {modality} placeholder(s) but {items} {noun} were given; put "
                      f"one {modality} token per item where it goes (the chat template does this).")


def _as_rgb(image: Any):
    from PIL import Image
    if not isinstance(image, Image.Image):
        raise ValueError(f"An image must be a PIL.Image; got {type(image).__name__}.")
    return image if image.mode == "RGB" else image.convert("RGB")


def _clip_parts(clip: Any, default_rate: int) -> tuple[np.ndarray, int]:
    """vLLM's audio item, `(samples, sample_rate)` or bare samples (at the model's rate), checked: 1-D float samples
    and a rate in 1 Hz to MAX_SAMPLE_RATE."""
    samples, rate = clip if isinstance(clip, (tuple, list)) and len(clip) == 2 else (clip, default_rate)
    if hasattr(samples, "detach"):  # a torch tensor
        samples = samples.detach().cpu().float().numpy()
    if not isinstance(samples, np.ndarray) or isinstance(rate, bool) or not isinstance(
            rate, (int, float, np.integer, np.floating)):
        raise ValueError("An audio item must be (samples, sample_rate): a 1-D float array and its rate in Hz; "
                         f"got {type(clip).__name__}.")
    if samples.ndim != 1 or samples.dtype.kind != "f":
        raise ValueError(f"Audio samples must be a 1-D (mono) float array in [-1, 1]; got shape {samples.shape} "
                         f"of {samples.dtype}.")
    if not 0 < rate <= MAX_SAMPLE_RATE or int(rate) != rate:
        raise ValueError(f"An audio sample rate must be a whole number of Hz from 1 to {MAX_SAMPLE_RATE}; got {rate}.")
    return samples, int(rate)
