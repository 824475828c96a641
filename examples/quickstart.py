"""Convert the bundled tiny Qwen3-MoE and generate from it under a device budget.

    python examples/quickstart.py
"""

from pathlib import Path

import jmoe
from convert import convert_checkpoint

HERE = Path(__file__).resolve().parent
out = HERE.parent / "out" / "tiny-qwen3-moe"
if not out.exists():
    convert_checkpoint(HERE / "tiny-qwen3-moe", out)

model = jmoe.load(out, device_budget="64MiB")
print(model)

# Greedy, whole answer at once.
print(jmoe.generate(model, "def fibonacci(n):", max_new_tokens=48))

# Sampled and streamed, stopping at a blank line.
for piece in jmoe.generate(model, "The tutorial", max_new_tokens=64, temperature=0.8, top_p=0.9, seed=0,
                           stop="\n\n", stream=True):
    print(piece, end="", flush=True)
print()

# Perplexity of a short text.
ids = model.tokenizer.encode("import os\nimport sys\n\ndef main():\n    return 0\n")
print("perplexity:", round(jmoe.perplexity(model, ids, window=len(ids)), 2))
