"""`pressroom chat`: an interactive terminal conversation that prints tokens as they are generated."""
from __future__ import annotations

import sys


def run_chat(args, engine_kwargs: dict, stdin=None, stdout=None) -> int:
    from pressroom import LLM
    from pressroom.entrypoints.cli import _params
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    llm = LLM(**engine_kwargs)
    params = _params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = stdin.isatty()
    if interactive:
        stdout.write("pressroom chat — empty line or Ctrl-D to quit\n")
    for turn in range(1_000_000):
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line or not line.strip():
            return 0
        messages.append({"role": "user", "content": line.strip()})
        reply = stream_reply(llm, messages, params, f"chat-{turn}", stdout)
        messages.append({"role": "assistant", "content": reply})
    return 0


def stream_reply(llm, messages, params, request_id: str, stdout) -> str:
    engine = llm.engine
    engine.add_request(request_id, {"prompt_token_ids": llm.apply_chat_template(messages)}, params)
    shown = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            stdout.write(text[len(shown):])
            stdout.flush()
            shown = text
    stdout.write("\n")
    stdout.flush()
    return shown
