"""A checkpoint's pooling defaults: sentence-transformers' modules where the directory has them, else vLLM's."""
from __future__ import annotations

import json
import os

from pressroom.pooling_params import PoolingParams

# sentence-transformers' Pooling config flag -> pressroom's pooling type
_ST_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS", "pooling_mode_lasttoken": "LAST"}


def model_pooling_defaults(path: str, encoder_only: bool) -> PoolingParams:
    """What a request that names no pooling gets: the sentence-transformers modules' pooling mode and whether
    they end in Normalize; without them, CLS for an encoder and LAST for a decoder (vLLM's), normalised."""
    modules = _read_json(os.path.join(path, "modules.json")) if os.path.isdir(path) else None
    fallback = PoolingParams("CLS" if encoder_only else "LAST", True)
    if not isinstance(modules, list):
        return fallback
    types = {m.get("type", ""): m.get("path", "") for m in modules if isinstance(m, dict)}
    normalize = any(t.endswith(".Normalize") for t in types)
    pooling_dir = next((p for t, p in types.items() if t.endswith(".Pooling")), None)
    config = _read_json(os.path.join(path, pooling_dir, "config.json")) if pooling_dir is not None else None
    if not isinstance(config, dict):
        return PoolingParams(fallback.pooling_type, normalize)
    modes = [mode for flag, mode in _ST_MODES.items() if config.get(flag)]
    if len(modes) != 1 or any(config.get(f) for f in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens")):
        raise ValueError(f"The sentence-transformers pooling config in {path!r} asks for a mode pressroom does not "
                         "implement (one of mean, cls or lasttoken is supported); pass --pooler-config to choose.")
    return PoolingParams(modes[0], normalize)


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
