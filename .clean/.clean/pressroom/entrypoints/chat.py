"""`pressroom chat`: an interactive terminal conversation that prints tokens as they are generated."""
from __future__ import annotations

import sys


def run_chat(args, engine_kwargs: dict, stdin=None, stdout=None) -> int:
    from pressroom import LLM
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    llm = LLM(**engine_kwargs)
    params = sampling_params(args)
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


def sampling_params(args):
    """The sampling flags `generate` and `chat` share, as SamplingParams."""
    from pressroom import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.request_seed)
