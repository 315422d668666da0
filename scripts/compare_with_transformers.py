"""Load an artifact with plain transformers in a process that never imports optkit, and
compare its logits with optkit's own dequantized reading of the same files.

    .venv/bin/python scripts/compare_with_transformers.py ARTIFACT [--prompt TEXT] [--new-tokens N]

Prints the max absolute logit difference over the prompt and transformers' greedy
continuation (chat template applied when the tokenizer has one).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch
from transformers import AutoTokenizer

from optkit.export import load_dequantized_model

_PLAIN = textwrap.dedent(
    """
    import sys, time, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    art, prompt, n, dst = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(art, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(art)
    print(f"transformers load: {time.perf_counter() - t0:.1f}s")
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        torch.save(model(**ids).logits, dst)
    if tok.chat_template:
        chat = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)
        out = model.generate(**chat, max_new_tokens=n, do_sample=False)
        print("greedy (chat):", repr(tok.decode(out[0][chat["input_ids"].shape[1]:], skip_special_tokens=True)))
    else:
        out = model.generate(**ids, max_new_tokens=n, do_sample=False)
        print("greedy:", repr(tok.decode(out[0][ids["input_ids"].shape[1]:], skip_special_tokens=True)))
    assert "optkit" not in sys.modules, "optkit was imported"
    print("optkit imported in this process: no")
    """
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--new-tokens", type=int, default=40)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script, dst = Path(tmp) / "plain.py", Path(tmp) / "logits.pt"
        script.write_text(_PLAIN)
        res = subprocess.run(
            [sys.executable, "-I", str(script), str(args.artifact), args.prompt, str(args.new_tokens), str(dst)],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            sys.exit(f"plain transformers failed to load {args.artifact}:\n{res.stderr[-4000:]}")
        print(res.stdout, end="")
        hf = torch.load(dst, weights_only=True)
    model = load_dequantized_model(args.artifact)
    tok = AutoTokenizer.from_pretrained(str(args.artifact))
    with torch.no_grad():
        ours = model(**tok(args.prompt, return_tensors="pt")).logits
    diff = (hf - ours).abs()
    print(f"logits vs optkit's dequantized model: max abs diff {diff.max().item():.3g}, mean {diff.mean().item():.3g}")


if __name__ == "__main__":
    main()
