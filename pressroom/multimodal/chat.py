"""Chat messages with OpenAI content parts: the media taken out (in order, per modality) and each replaced by the part
chat templates render as its placeholder (`TEMPLATE_PARTS`: HF's convention, `{"type": "image"}`,
`{"type": "audio", "audio": ""}`; Qwen2-Audio's template looks for the "audio" key; `{"type": "video"}`). Images
come as `image_url` (or `image_pil` / `image` holding a PIL image), audio as `input_audio` ({"data": base64,
"format": "wav"}) or `audio_url`, video as `video_url` (its frames sampled as it is decoded); URLs are loaded by
multimodal/media.py under a MediaPolicy (offline: data URLs only unless the policy allows more)."""
from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pressroom.multimodal.media import MediaPolicy, check_counts, load_audio, load_audio_base64, load_image, load_video

PART_MODALITIES = {"image_url": "image", "image_pil": "image", "image": "image", "input_audio": "audio",
                   "audio_url": "audio", "video_url": "video"}
TEMPLATE_PARTS = {"image": {"type": "image"}, "audio": {"type": "audio", "audio": ""}, "video": {"type": "video"}}
NOUNS = {"image": "images", "audio": "audio", "video": "video"}


def template_part(modality: str) -> dict[str, Any]:
    """The content part a chat template renders as one `modality` placeholder."""
    return dict(TEMPLATE_PARTS[modality])


def takes_phrase(modalities: Collection[str]) -> str:
    """What a model takes, in words: "images and text", "images, video and text", "text only"."""
    kinds = [NOUNS[m] for m in sorted(modalities)]
    return ", ".join(kinds) + " and text" if kinds else "text only"


def extract_media(messages: list[dict[str, Any]], modalities: Collection[str], policy: MediaPolicy | None = None,
                  model: str = "this model") -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """(messages for the chat template, their media by modality in order of appearance). `modalities`: what the
    model takes; a part of another is a ValueError naming `model` and what it takes."""
    policy = policy or MediaPolicy()
    media: dict[str, list[Any]] = {}
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            modality = PART_MODALITIES.get(kind)
            if modality is None:
                parts.append(part)
                continue
            if modality not in modalities:
                raise ValueError(f"Content part {kind!r}: {model} takes no {NOUNS[modality]}; it takes "
                                 f"{takes_phrase(modalities)}.")
            media.setdefault(modality, []).append(_LOADERS[modality](part, kind, policy))
            parts.append(template_part(modality))
        out.append({**message, "content": parts})
    check_counts({m: len(items) for m, items in media.items()}, policy)
    return out, media


def _image_of(part: dict[str, Any], kind: str, policy: MediaPolicy):
    if kind == "image_pil" or (kind == "image" and not isinstance(part.get("image"), (str, dict))):
        image = part.get(kind)
        if image is None:
            raise ValueError(f"Content part {kind!r} has no image.")
        return image
    return load_image(_url_of(part, kind, "data:image/png;base64,..."), policy)


def _audio_of(part: dict[str, Any], kind: str, policy: MediaPolicy):
    """(mono float32 samples, sample rate) of an input_audio or audio_url part, past media.py's guards."""
    if kind == "input_audio":
        body = part.get("input_audio")
        if not isinstance(body, dict) or not isinstance(body.get("data"), str) or not isinstance(
                body.get("format", ""), str):
            raise ValueError('Content part \'input_audio\' needs {"data": <base64>, "format": "wav"|"mp3"|"flac"|'
                             '"ogg"}.')
        return load_audio_base64(body["data"], body.get("format") or None, policy)
    return load_audio(_url_of(part, kind, "data:audio/wav;base64,..."), policy)


def _url_of(part: dict[str, Any], kind: str, example: str) -> str:
    ref = part.get(kind)
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise ValueError(f"Content part {kind!r} needs a URL (e.g. {{\"url\": \"{example}\"}}).")
    return url


def _video_of(part: dict[str, Any], kind: str, policy: MediaPolicy):
    """A video_url part's sampled frames, [frames, height, width, 3] uint8, past media.py's guards, with their
    metadata (the stream's fps and the frames kept)."""
    return load_video(_url_of(part, kind, "data:video/mp4;base64,..."), policy, with_metadata=True)


_LOADERS = {"image": _image_of, "audio": _audio_of, "video": _video_of}
