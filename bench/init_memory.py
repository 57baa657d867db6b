"""Peak host memory of building one rank's model: the full model sliced afterwards, against
deferred init that draws only the rank's shards (`layers.materialize_`), side by side.

    python bench/init_memory.py [--ep 8] [--layers 8]

Each mode runs in a fresh process (peak RSS is per process). The model is Qwen3-30B-A3B's
shape with fewer layers and experts, so the full build fits this machine: the comparison is
about what a rank holds, not about the model's size. The rank is ep rank 0 of `--ep` (tp 1).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys
from moeplan.runtime.comm import SINGLE, Axis
from moeplan.runtime.layers import materialize_
from moeplan.runtime.model import Transformer
from moeplan.runtime.parallelize import ExpertParallel, apply_ep
from moeplan.specs import ModelSpec, load_model

mode, ep, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
base = load_model("qwen3-30b-a3b")
spec = ModelSpec.model_validate(base.model_copy(update=dict(
    name="qwen3-30b-a3b-short", num_layers=layers, num_experts=64)).model_dump())
axis = Axis(None, ep, 0, tuple(range(ep)))
model = Transformer(spec, seed=0, materialize=mode == "full")
apply_ep(model, ExpertParallel(ep=axis, tp_ep=axis))  # keep ep rank 0's experts
materialize_(model, 0)
held = sum(p.numel() * p.element_size() for p in model.parameters())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"mode": mode, "peak_gb": peak / 1e9, "held_gb": held / 1e9,
                  "full_gb": spec.total_params() * 4 / 1e9}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    rows = []
    for mode in ("full", "deferred"):
        out = subprocess.run([sys.executable, "-c", CHILD, mode, str(a.ep), str(a.layers)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"Qwen3-30B-A3B shape, {a.layers} layers, 64 experts (fp32 weights, "
          f"{rows[0]['full_gb']:.2f} GB in all); ep rank 0 of {a.ep}, tp 1\n")
    print("| build | peak RSS GB | weights held GB |")
    print("|---|---:|---:|")
    for r in rows:
        name = ("full model, then sliced" if r["mode"] == "full"
                else "deferred, this rank's shards only")
        print(f"| {name} | {r['peak_gb']:.2f} | {r['held_gb']:.2f} |")
    print(f"\npeak ratio (full / deferred): {rows[0]['peak_gb'] / rows[1]['peak_gb']:.2f}×")


if __name__ == "__main__":
    main()
