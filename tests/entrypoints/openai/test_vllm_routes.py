"""vLLM's extra routes on the tiny server: SageMaker's /ping and /invocations (dispatched by the body's fields as
vLLM does), and the development routes absent unless VLLM_SERVER_DEV_MODE is set."""
from __future__ import annotations

import httpx


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


def test_chat_template_and_its_default_kwargs_from_the_command_line(tiny_model_dir, tmp_path, smollm_tokenizer):
    """--chat-template (a file) in place of the tokenizer's, --default-chat-template-kwargs under each request's
    own chat_template_kwargs."""
    from conftest import tiny_args
    from serving import serve
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}{{ greeting }}")
    args = tiny_args(tiny_model_dir("llama"), "--chat-template", str(template),
                     "--default-chat-template-kwargs", '{"greeting": " HELLO"}')
    with serve(args, tmp_path / "server.log") as (url, _):
        def rendered(**extra) -> str:
            body = {"messages": [{"role": "user", "content": "hi"}], **extra}
            ids = httpx.post(f"{url}/tokenize", json=body).json()["tokens"]
            return smollm_tokenizer.decode(ids)
        assert rendered() == "<hi> HELLO"
        assert rendered(chat_template_kwargs={"greeting": " BYE"}) == "<hi> BYE"

