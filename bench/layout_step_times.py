"""Per-step time of each equivalence layout (fp32, CPU, gloo), from one spawned world.

Runs `tests/equivalence_worker.py` (the same world and layouts the equivalence tests use) and
prints the median step time of each layout and model, steps 2 and 3 (step 1 includes warm-up).
On a small CPU machine these times measure gloo latency and process scheduling far more than
compute; they are recorded to notice regressions, not to predict GPU step times.

    python bench/layout_step_times.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

WORKER = Path(__file__).resolve().parent.parent / "tests" / "equivalence_worker.py"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.pt"
        subprocess.run([sys.executable, str(WORKER), str(out)], check=True,
                       stderr=subprocess.DEVNULL)
        results = torch.load(out)
    models = sorted({m for _, m in results})
    print("| layout | " + " | ".join(models) + " |")
    print("|---|" + "---|" * len(models))
    for layout in dict.fromkeys(name for name, _ in results):
        cells = []
        for m in models:
            r = results.get((layout, m))
            cells.append("—" if r is None else
                         f"{statistics.median(r['step_time_s'][1:]) * 1e3:.0f} ms")
        print(f"| {layout} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
