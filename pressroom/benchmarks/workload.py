"""The workloads `pressroom bench` runs, identical for every backend (token-id prompts, seeded)."""
from __future__ import annotations

import json
import os
import platform
import random
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_len: int
    ignore_eos: bool = True

    @property
    def num_input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def as_dict(self) -> dict:
        return asdict(self)


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Uniform token ids away from the special-token range, like `vllm bench --dataset-name random`."""
    rng = random.Random(seed)
    low, high = min(1000, vocab_size // 4), vocab_size - 1
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(num)]


def read_prompt_texts(path: str) -> list[str]:
    """Prompts from a JSONL ({"prompt": ...} per line) or plain text file (one per line)."""
    texts = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                texts.append(json.loads(line)["prompt"] if line.startswith("{") else line)
    if not texts:
        raise ValueError(f"No prompts found in {path!r}.")
    return texts


def file_prompts(path: str, tokenizer, num: int, input_len: int | None, chat: bool = False) -> list[list[int]]:
    """Token ids of the file's prompts, cycled to `num`; `chat`: each as one user turn of the chat template."""
    ids = [_chat_ids(tokenizer, t) if chat else tokenizer.encode(t) for t in read_prompt_texts(path)]
    if input_len:
        ids = [p[:input_len] for p in ids]
    return [ids[i % len(ids)] for i in range(num)]


def _chat_ids(tokenizer, text: str) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat needs a model whose tokenizer has a chat template.")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def machine() -> dict:
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def report_from_args(args, run, plot) -> dict:
    """A bench's report: loaded from --from-json, or run (and saved to --output-json); plotted to --plot."""
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
    else:
        report = run(args)
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, args.plot)
    return report
