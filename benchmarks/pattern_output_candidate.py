"""The ``pattern_output`` metric of one model on a text sample, saved for
``benchmarks/agreement_candidates.py --extra`` (its agreement with function beside every other
score, on the noise-aware statistics).

Boots the model as the ``moments`` rule does (``boot_and_measure_moments(pattern_output=True)``)
on ``--windows`` windows of ``--length`` tokens of the config's text sample (``--text induction``:
random pool tokens, each window's second half a copy of its first: the function's own task's
statistics), and saves ``pattern_output_<comp>`` [L, H, L, H] as numpy arrays.

    .venv/bin/python benchmarks/pattern_output_candidate.py --model smollm2-135m --windows 8 \\
        --meta results/weights/smollm2-135m/final/meta.json --out po_stdlib.npz [--text induction]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import yaml

from compatlas.composition.moments import boot_and_measure_moments
from compatlas.plan import build_plan, thaw

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "config" / "config.yaml"))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--meta", required=True, help="the model's extraction meta.json (results/weights/<model>/<ckpt>/)")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--length", type=int, default=0, help="0: the config's")
    p.add_argument("--text", default="", help="'induction' for the task's own statistics; '': the config's sample")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    plan = build_plan(yaml.safe_load(Path(args.config).read_text()), check_sources=False)
    m = plan.models[args.model]
    settings = thaw(m.activation) | {"chunks": args.windows}
    settings["length"] = args.length or settings["length"]
    if args.text:
        settings["text"] = {"kind": args.text}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        moments, _ = boot_and_measure_moments(args.model, thaw(m.entry), None, settings, thaw(m.induction), args.meta,
                                              Path(tmp), args.device, pattern_output=True)
    assert moments.pattern_output is not None
    np.savez_compressed(args.out, **{f"pattern_output_{c}": t.numpy() for c, t in moments.pattern_output.items()})
    print(f"{args.model}: pattern_output over {args.windows} x {settings['length']} tokens "
          f"({settings['text']['kind']}) in {time.perf_counter() - t0:.0f} s -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
