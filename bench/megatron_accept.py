"""Megatron-LM's own argument and config validation on every plan of the acceptance set.

    python bench/megatron_accept.py --megatron-lm DIR [--python PY] [--te-version 2.12.0]

DIR is a Megatron-LM checkout (the export targets commit d98e8a6); PY a Python ≥ 3.12 that
imports torch, triton, numpy, packaging and einops (Megatron-LM's own imports). For the top
three plans of each acceptance search and every hand layout of docs/EXPORT.md, the export's
flags (placeholders filled as a user fills them) and its `export NAME=value` lines (as the
environment) go through what `pretrain_gpt.py` runs before it builds the model:
`parse_args` → `validate_args` → the micro-batch calculator → `gpt_config_from_args` (which
runs TransformerConfig / MLATransformerConfig validation), in a fresh process each, on CPU.
Stood in, and only these: the GPU architecture of the plan's cluster, the Transformer Engine
version, and the TE kernels' presence. Every value Megatron parsed is compared with the plan's.
Prints one line per plan and the count accepted; exits 1 unless all are.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from megatron_core_config import acceptance_plans, filled, parsed_values  # noqa: E402

from moeplan.planner.export import export  # noqa: E402

ARCH = {"ampere": 8, "hopper": 9, "blackwell": 10}

DRIVER = r'''
import json, sys, warnings
warnings.filterwarnings("ignore")
spec = json.loads(sys.argv[1])
import torch
arch = spec["arch"]
torch.cuda.get_device_capability = lambda *a, **k: (arch, 0)   # the GPU architecture
import megatron.core.utils as cu
from packaging.version import Version
cu._te_version = Version(spec["te_version"])                    # the TE version
import megatron.core.transformer.moe.moe_utils as mu
import megatron.core.models.common.embeddings.rope_utils as ru
def kernel(*a, **k):
    raise RuntimeError("a stand-in for a Transformer Engine kernel was called")
for n in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
          "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
    setattr(mu, n, kernel)                                       # the TE kernels' presence
ru.fused_apply_rotary_pos_emb = kernel
import megatron.training.arguments as A
A.get_device_arch_version = lambda: arch
from megatron.training.argument_utils import gpt_config_from_args
from megatron.core.num_microbatches_calculator import (get_num_microbatches,
                                                        init_num_microbatches_calculator)
sys.argv = ["pretrain_gpt.py", *spec["argv"]]
try:
    args = A.parse_args()
    A.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})  # pretrain_gpt.py's defaults
    init_num_microbatches_calculator(          # as global_vars.set_global_variables calls it
        rank=args.rank, global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        data_parallel_size=args.data_parallel_size * args.gtp_weight_remat_size,
        decrease_batch_size_if_needed=args.decrease_batch_size_if_needed,
        step_batch_size_schedule=args.step_batch_size_schedule, seq_length=args.seq_length)
    t = gpt_config_from_args(args).transformer
    moe = t.num_moe_experts is not None
    rec = t.recompute_granularity
    out = {"ok": True, "tp": t.tensor_model_parallel_size, "pp": t.pipeline_model_parallel_size,
           "cp": t.context_parallel_size, "ep": t.expert_model_parallel_size,
           "etp": t.expert_tensor_parallel_size if moe else None,
           "vpp": t.virtual_pipeline_model_parallel_size or 1, "dp": args.data_parallel_size,
           "mbs": args.micro_batch_size, "gbs": args.global_batch_size,
           "num_microbatches": get_num_microbatches(), "num_layers": t.num_layers,
           "mtp_num_layers": t.mtp_num_layers, "recompute_granularity": rec,
           "recompute_modules": sorted(t.recompute_modules) if rec == "selective" else None,
           "offload_modules": (sorted(t.offload_modules)
                               if t.fine_grained_activation_offloading else None)}
except BaseException as e:
    out = {"ok": False, "error": f"{type(e).__name__}: {e}".strip()[:400]}
print("RESULT " + json.dumps(out))
'''


def check(plan, megatron_lm: str, python: str, te_version: str) -> dict:
    doc = export(plan)
    spec = {"arch": ARCH[plan.cluster.architecture], "te_version": te_version,
            "argv": filled(doc["args"])}
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_DEVICE_MAX_CONNECTIONS", "NVTE_CPU_OFFLOAD_V1")}
    env.update(doc["env"], WORLD_SIZE=str(plan.world_size), RANK="0", PYTHONPATH=megatron_lm)
    proc = subprocess.run([python, "-c", DRIVER, json.dumps(spec)], env=env, text=True,
                          capture_output=True, timeout=600, cwd=tempfile.gettempdir())
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        return {"ok": False, "error": proc.stderr.strip().splitlines()[-1][:400]}
    got = json.loads(lines[-1][7:])
    if got["ok"]:
        want = parsed_values(plan)
        got["mismatch"] = {k: (got[k], want[k]) for k in want if got.get(k) != want[k]}
        got["ok"] = not got["mismatch"]
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout")
    ap.add_argument("--python", default=sys.executable, help="Python for Megatron-LM (≥ 3.12)")
    ap.add_argument("--te-version", default="2.12.0", help="the Transformer Engine stood in")
    opts = ap.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        plans = acceptance_plans(Path(tmp))
    accepted = 0
    for label, plan in plans:
        r = check(plan, opts.megatron_lm, opts.python, opts.te_version)
        accepted += r["ok"]
        why = "" if r["ok"] else f"  {r.get('error') or r.get('mismatch')}"
        print(f"{'accepted' if r['ok'] else 'REFUSED '}  {label}: {plan.summary()}{why}")
    print(f"{accepted} of {len(plans)} accepted by Megatron-LM's parse_args → validate_args → "
          f"micro-batch calculator → gpt_config_from_args ({time.perf_counter() - start:.0f} s)")
    return 0 if accepted == len(plans) else 1


if __name__ == "__main__":
    sys.exit(main())
