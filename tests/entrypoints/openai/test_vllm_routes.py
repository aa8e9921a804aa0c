"""vLLM's extra routes on the tiny server: SageMaker's /ping and /invocations (dispatched by the body's fields as
vLLM does), and the development routes absent unless VLLM_SERVER_DEV_MODE is set."""
from __future__ import annotations

import httpx
import pytest


def test_ping_answers_as_health(tiny_server):
    assert httpx.get(f"{tiny_server}/ping").status_code == 200


def test_invocations_dispatch_by_the_bodys_fields(tiny_server):
    chat = httpx.post(f"{tiny_server}/invocations", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 3}, timeout=60)
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = httpx.post(f"{tiny_server}/invocations", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    neither = httpx.post(f"{tiny_server}/invocations", json={"text": "hi"})
    assert neither.status_code == 400 and "Cannot tell the request's type" in neither.json()["error"]["message"]
    not_json = httpx.post(f"{tiny_server}/invocations", content=b"{not json",
                          headers={"Content-Type": "application/json"})
    assert not_json.status_code == 400
    assert httpx.post(f"{tiny_server}/invocations", content=b"{}").status_code == 415  # a browser's form post
    bad_chat = httpx.post(f"{tiny_server}/invocations", json={"messages": "not a list"})
    assert bad_chat.status_code == 400  # the chat handler's own validation, on the body read once


def test_development_routes_need_dev_mode(tiny_server):
    for path in ("/server_info", "/is_sleeping"):
        assert httpx.get(f"{tiny_server}{path}").status_code == 404
    assert httpx.post(f"{tiny_server}/sleep").status_code == 404



def test_chat_template_and_its_default_kwargs_from_the_command_line(tmp_path, smollm_tokenizer):
    """--chat-template (a file) in place of the tokenizer's, --default-chat-template-kwargs under each request's
    own chat_template_kwargs: the serve command's flags, read into the settings the server renders with."""
    import asyncio

    from pressroom.entrypoints.cli import build_parser
    from pressroom.entrypoints.openai.chat_template import Preprocessor
    from pressroom.entrypoints.openai.settings import ServerSettings
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}{{ greeting }}")
    args = build_parser().parse_args(["serve", "--chat-template", str(template),
                                      "--default-chat-template-kwargs", '{"greeting": " HELLO"}'])
    settings = ServerSettings.from_args(args)
    preprocessor = Preprocessor(smollm_tokenizer, 1 << 20, chat_template=settings.chat_template,
                                default_template_kwargs=settings.default_chat_template_kwargs)

    async def rendered(kwargs=None) -> str:
        await preprocessor.start()
        try:
            ids = await preprocessor.chat_ids([{"role": "user", "content": "hi"}], True, False, kwargs)
        finally:
            await preprocessor.close()
        return smollm_tokenizer.decode(ids)
    assert asyncio.run(rendered()) == "<hi> HELLO"
    preprocessor = Preprocessor(smollm_tokenizer, 1 << 20, chat_template=settings.chat_template,
                                default_template_kwargs=settings.default_chat_template_kwargs)
    assert asyncio.run(rendered({"greeting": " BYE"})) == "<hi> BYE"
    inline = ServerSettings.from_args(build_parser().parse_args(["serve", "--chat-template", "{{ 1 }}"]))
    assert inline.chat_template == "{{ 1 }}"
    with pytest.raises(ValueError, match="neither a file nor a template"):
        ServerSettings.from_args(build_parser().parse_args(["serve", "--chat-template", "no/such.jinja"]))


def test_several_api_keys_and_vllm_api_key(monkeypatch):
    """--api-key takes several keys, any one accepted; without it VLLM_API_KEY's is the key (vLLM's rules)."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from pressroom.entrypoints.cli import build_parser
    from pressroom.entrypoints.openai.server import _Guard
    from pressroom.entrypoints.openai.settings import ServerSettings

    def settings(*flags: str) -> ServerSettings:
        return ServerSettings.from_args(build_parser().parse_args(["serve", *flags]))
    assert settings("--api-key", "k1", "k2").api_keys == ("k1", "k2")
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert settings().api_keys == ("from-env",) and settings("--api-key", "k1").api_keys == ("k1",)
    monkeypatch.delenv("VLLM_API_KEY")
    assert settings().api_keys == ()

    app = _Guard(Starlette(routes=[Route("/v1/models", lambda r: PlainTextResponse("ok"))]), ("k1", "k2"), None, ())

    async def status(key: str | None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return (await client.get("/v1/models", headers=headers)).status_code
    assert [asyncio.run(status(k)) for k in ("k1", "k2", "k3", None)] == [200, 200, 401, 401]


def test_vllm_logging_level_sets_the_level_without_a_flag(monkeypatch):
    import logging

    from pressroom.logger import configure_logging
    monkeypatch.delenv("PRESSROOM_LOGGING_LEVEL", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "debug")
    logger = logging.getLogger("pressroom")
    level = logger.level
    try:
        configure_logging(None)
        assert logger.level == logging.DEBUG
        configure_logging("WARNING")  # a --log-level wins
        assert logger.level == logging.WARNING
    finally:
        logger.setLevel(level)
