"""Images through the server: `pressroom serve` of a tiny Qwen2.5-VL answers a chat whose image comes as a data URL
(the official openai client, whole and streamed) with the tokens `LLM.chat` gives offline for the same message; the
image steers the answer; an audio part is a 400 saying the model takes images, video and text."""
from __future__ import annotations

import base64
import io

import openai
import pytest
from serving import serve
from tiny_vl import png_data_url, random_image

from pressroom import LLM, SamplingParams

MAX_TOKENS = 8


def _silence_wav() -> bytes:
    import numpy as np
    import soundfile
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(1600, dtype=np.float32), 16000, format="WAV")
    return buf.getvalue()


def _messages(image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(image)}},
                                         {"type": "text", "text": "Describe it."}]}]


@pytest.mark.slow  # a server start of its own (~10 s quiet) beside the offline engine
def test_image_chat_through_the_server_equals_offline(tiny_vl, tmp_path):
    path = tiny_vl[0]
    image, other = random_image(7, (80, 120)), random_image(8, (80, 120))
    offline = LLM(path, dtype="float32", kv_cache_memory_gib=0.05)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [offline.chat(_messages(img), params, use_tqdm=False)[0].outputs[0].token_ids for img in (image, other)]
    assert want[0] != want[1]  # the image steers the answer
    offline.shutdown()
    args = ["serve", path, "--dtype", "float32", "--kv-cache-memory-gib", "0.05"]
    with serve(args, tmp_path / "server.log") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        for img, tokens in zip((image, other), want):
            body = dict(model=path, messages=_messages(img), max_tokens=MAX_TOKENS, temperature=0,
                        extra_body={"ignore_eos": True, "return_token_ids": True})
            whole = client.chat.completions.create(**body)
            assert whole.choices[0].model_extra["token_ids"] == list(tokens)
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                **body, stream=True) if c.choices)
            assert streamed == whole.choices[0].message.content
        with pytest.raises(openai.BadRequestError, match="takes images, video and text"):
            wav = base64.b64encode(_silence_wav()).decode()
            client.chat.completions.create(model=path, max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]}])
