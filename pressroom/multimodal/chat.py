"""Chat messages with OpenAI content parts: the images taken out (in order) and each replaced by the part chat
templates render as an image placeholder, `{"type": "image"}` (HF's convention; Qwen-VL's template also takes
`image_url`). Image URLs are loaded by multimodal/media.py under a MediaPolicy (offline: data URLs only unless the
policy allows more)."""
from __future__ import annotations

from typing import Any

from pressroom.multimodal.media import MediaPolicy, check_counts, load_image

_IMAGE_PARTS = ("image_url", "image_pil", "image")
_REFUSED_PARTS = ("input_audio", "audio_url", "video_url")


def extract_images(messages: list[dict[str, Any]], policy: MediaPolicy | None = None
                   ) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages for the chat template, their images in order of appearance)."""
    policy = policy or MediaPolicy()
    images: list[Any] = []
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _IMAGE_PARTS:
                images.append(_image_of(part, kind, policy))
                parts.append({"type": "image"})
            elif kind in _REFUSED_PARTS:
                raise ValueError(f"Content part {kind!r} is not supported yet (images only).")
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    check_counts({"image": len(images)}, policy)
    return out, images


def _image_of(part: dict[str, Any], kind: str, policy: MediaPolicy):
    if kind == "image_pil" or (kind == "image" and not isinstance(part.get("image"), (str, dict))):
        image = part.get(kind)
        if image is None:
            raise ValueError(f"Content part {kind!r} has no image.")
        return image
    ref = part.get(kind)
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise ValueError(f"Content part {kind!r} needs a URL (e.g. {{\"url\": \"data:image/png;base64,...\"}}).")
    return load_image(url, policy)
