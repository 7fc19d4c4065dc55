#!/usr/bin/env python
"""Peak memory of weight extraction: streaming (compatlas.models.streaming) against today's path
(the whole model booted in float32 through TransformerBridge), measured in the same run.

Usage::

    python benchmarks/bench_extract_memory.py [--quick] [--workdir DIR] [--reference-layers N]
                                              [--reference-limit-gb G] [--keep]

The model: a synthetic Llama with Llama-2-70B attention shapes (d_model 8192, 64 query heads,
8 KV heads, d_head 128), its full-width MLP (28672), vocabulary 32000 and 2 layers, written as
sharded bfloat16 safetensors (about 4.5 GB) one tensor at a time, never holding the model.
Each extraction runs through the pipeline's entry point (``loading.load_and_extract`` on a
``local`` source, then ``weights.save_weights``, as the extract rule does) in a child process
of its own; its peak RSS is the child's ``ru_maxrss``. Target: streaming's peak RSS
at most 1.5x the bytes of the float32 tensors it extracts, with ``none`` and ``compat``.

Today's path holds the whole model in float32 (about 9 GB at 2 layers, before processing
copies), more than this shared 24 GB machine should give one job: it is measured on the same
shapes with ``--reference-layers`` layers (1 by default; the same shard files, a config with
fewer layers), streaming is measured on that model too, and the ratio between the two is
printed. A child whose RSS passes ``--reference-limit-gb`` (12) is killed and reported as such.
``--quick`` shrinks every dimension (smoke test, about a minute). The files are deleted at the
end unless ``--keep``. Results go to stdout and to benchmarks/results/extract-memory-<host>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES = {
    "llama2-70b-2l": dict(n_layers=2, d_model=8192, n_heads=64, n_kv_heads=8, d_head=128, d_mlp=28672, d_vocab=32000),
    "quick": dict(n_layers=2, d_model=1024, n_heads=8, n_kv_heads=2, d_head=128, d_mlp=3584, d_vocab=4000),
}
TARGET = 1.5
GIB = 1024 ** 3
RUNNING: list = []  # the child being measured, killed if the benchmark itself is stopped


# ----------------------------------------------------------------------------- the model


def write_model(folder: Path, s: dict, seed: int = 0) -> int:
    """A Llama checkpoint in bfloat16 shards, generated tensor by tensor (at most one shard of
    about 1 GB in memory). Returns the bytes written."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from compatlas.models.small_models import word_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    LlamaConfig(num_hidden_layers=s["n_layers"], hidden_size=s["d_model"], num_attention_heads=s["n_heads"],
                num_key_value_heads=s["n_kv_heads"], head_dim=s["d_head"], intermediate_size=s["d_mlp"],
                vocab_size=s["d_vocab"], max_position_embeddings=4096, tie_word_embeddings=False,
                torch_dtype="bfloat16").save_pretrained(folder)
    word_tokenizer(s["d_vocab"], folder)
    g = torch.Generator().manual_seed(seed)
    d, H, Hkv, dh, m, V = (s[k] for k in ("d_model", "n_heads", "n_kv_heads", "d_head", "d_mlp", "d_vocab"))

    def w(*shape):  # bfloat16 Gaussian, drawn in bfloat16 (no float32 copy of the tensor)
        return (torch.randn(*shape, generator=g, dtype=torch.bfloat16) * 0.02)

    def norm():
        return 1.0 + 0.1 * torch.randn(d, generator=g, dtype=torch.bfloat16)

    shards: list[dict] = [{"model.embed_tokens.weight": lambda: w(V, d)}]
    for i in range(s["n_layers"]):
        p = f"model.layers.{i}."
        shards.append({p + "input_layernorm.weight": norm, p + "self_attn.q_proj.weight": lambda: w(H * dh, d),
                       p + "self_attn.k_proj.weight": lambda: w(Hkv * dh, d), p + "self_attn.v_proj.weight": lambda: w(Hkv * dh, d),
                       p + "self_attn.o_proj.weight": lambda: w(d, H * dh), p + "post_attention_layernorm.weight": norm})
        for name, shape in (("gate_proj", (m, d)), ("up_proj", (m, d)), ("down_proj", (d, m))):
            shards.append({p + f"mlp.{name}.weight": (lambda shape=shape: w(*shape))})
    shards.append({"model.norm.weight": norm, "lm_head.weight": lambda: w(V, d)})
    weight_map, total = {}, 0
    n = len(shards)
    for j, shard in enumerate(shards, 1):
        fname = f"model-{j:05d}-of-{n:05d}.safetensors"
        tensors = {k: make() for k, make in shard.items()}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def fewer_layers(src: Path, dst: Path, n_layers: int) -> None:
    """The same checkpoint seen with fewer layers: a config of its own, the shard files linked."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.name == "config.json":
            cfg = json.loads(p.read_text())
            cfg["num_hidden_layers"] = n_layers
            (dst / p.name).write_text(json.dumps(cfg, indent=1))
        elif p.suffix == ".safetensors":
            (dst / p.name).symlink_to(p)
        elif p.name == "model.safetensors.index.json":
            idx = json.loads(p.read_text())
            keep = {f"model.layers.{i}." for i in range(n_layers)}
            idx["weight_map"] = {k: v for k, v in idx["weight_map"].items()
                                 if not k.startswith("model.layers.") or any(k.startswith(x) for x in keep)}
            (dst / p.name).write_text(json.dumps(idx, indent=1))
        elif p.is_file():
            shutil.copy(p, dst / p.name)


# ----------------------------------------------------------------------------- one extraction (child)


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(role: str, folder: Path, processing: str, out: Path, space_factors: bool = False) -> None:
    t0 = time.perf_counter()
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformer_lens.model_bridge  # noqa: F401 - both paths import these; counted as imports
    import transformers  # noqa: F401

    from compatlas.models.loading import load_and_extract
    from compatlas.models.weights import WEIGHT_KEYS, save_weights

    rss_imports = vm_rss(os.getpid())
    entry = {"source": {"kind": "local", "path": str(folder)}, "processing": processing}
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        t1 = time.perf_counter()
        w, bridge = load_and_extract("bench", entry, None, Path(tmp) / "work", streaming=(role == "streaming"))
        t_extract = time.perf_counter() - t1
        peak_extract = maxrss_bytes()
        if bridge is not None:
            del bridge
        t_space = cpu_space = None
        if space_factors:  # the rest of the extract rule: the token-space factors of W_E (float64)
            from compatlas.composition.token_space import add_space_factors

            t3, c3 = time.perf_counter(), time.process_time()
            add_space_factors(w)
            t_space, cpu_space = time.perf_counter() - t3, time.process_time() - c3
        peak_space = maxrss_bytes()
        t2 = time.perf_counter()
        save_weights(w, Path(tmp) / "w.safetensors", Path(tmp) / "w.json")
        t_save = time.perf_counter() - t2
        peak = maxrss_bytes()
        shard = (Path(tmp) / "w.safetensors").stat().st_size
    extracted = sum(getattr(w, k).numel() * 4 for k in WEIGHT_KEYS if getattr(w, k) is not None)
    out.write_text(json.dumps({
        "role": role, "processing": processing, "n_layers": w.n_layers, "extraction": w.meta.get("extraction", "bridge"),
        "rss_after_imports": rss_imports, "peak_after_extract": peak_extract, "peak": peak,
        "extracted_float32_bytes": extracted, "shard_bytes": shard, "extract_s": t_extract, "save_s": t_save,
        "space_factors_s": t_space, "space_factors_cpu_s": cpu_space, "peak_after_space_factors": peak_space if space_factors else None,
        "total_s": time.perf_counter() - t0,
    }))


def vm_rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_child(role: str, folder: Path, processing: str, workdir: Path, limit: float, space_factors: bool = False) -> dict:
    out = workdir / f"result-{role}-{processing}-{folder.name}{'-rule' if space_factors else ''}.json"
    cmd = [sys.executable, __file__, "--child", role, "--folder", str(folder), "--processing", processing, "--out", str(out)]
    cmd += ["--space-factors"] if space_factors else []
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    print(f"  {role:9s} {processing:6s} {folder.name}{' + space factors' if space_factors else ''} ...", end="", flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    RUNNING.append(proc)
    seen, killed = 0, False
    while proc.poll() is None:  # watchdog: today's path on a large model can take the machine
        seen = max(seen, vm_rss(proc.pid))
        if seen > limit:
            proc.send_signal(signal.SIGKILL)
            killed = True
        time.sleep(0.2)
    RUNNING.remove(proc)
    err = proc.stderr.read() if proc.stderr else ""
    if killed:
        print(f" killed at {seen / GIB:.1f} GiB")
        return {"role": role, "processing": processing, "killed_at": seen, "limit": limit}
    if proc.returncode != 0 or not out.exists():
        print(" failed")
        return {"role": role, "processing": processing, "error": err[-2000:]}
    res = json.loads(out.read_text())
    print(f" peak {res['peak'] / GIB:.2f} GiB (imports {res['rss_after_imports'] / GIB:.2f}), "
          f"extract {res['extract_s']:.0f} s, save {res['save_s']:.0f} s", flush=True)
    return res


# ----------------------------------------------------------------------------- report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workdir", type=Path, default=None, help="where the checkpoint goes (default: a temp dir under /tmp)")
    ap.add_argument("--reference-layers", type=int, default=1, help="layers of the model today's path is measured on")
    ap.add_argument("--reference-limit-gb", type=float, default=12.0)
    ap.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    ap.add_argument("--skip-space-factors", action="store_true",
                    help="skip the runs of the whole extract rule (extraction + token-space factors + save)")
    ap.add_argument("--skip-reference", action="store_true", help="skip today's path (and streaming on its smaller model)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--space-factors", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--write-model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--child", choices=["streaming", "bridge"], help=argparse.SUPPRESS)
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--processing", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.write_model:
        write_model(args.write_model, SHAPES[args.shape])
        return 0
    if args.child:
        child(args.child, args.folder, args.processing, args.out, args.space_factors)
        return 0

    # a stopped benchmark (timeout, Ctrl-C) still kills its child and deletes its files
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    shape_name = "quick" if args.quick else "llama2-70b-2l"
    s = SHAPES[shape_name]
    base = Path(tempfile.mkdtemp(prefix="bench-extract-", dir=args.workdir))
    limit = args.reference_limit_gb * GIB
    results: dict = {"shape": shape_name, "dims": s, "host": socket.gethostname(), "target": TARGET,
                     "reference_layers": args.reference_layers, "reference_limit_gb": args.reference_limit_gb,
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    try:
        full = base / f"{shape_name}"
        t0 = time.perf_counter()
        # written by a child: ru_maxrss survives exec, so the parent that starts the measured
        # children must never have been large itself (it imports no torch)
        subprocess.run([sys.executable, __file__, "--write-model", str(full), "--shape", shape_name], check=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
        written = json.loads((full / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
        results["checkpoint_bytes"] = written
        results["write_s"] = time.perf_counter() - t0
        print(f"wrote {written / GIB:.2f} GiB of bfloat16 shards in {results['write_s']:.0f} s to {full}", flush=True)
        small = base / f"{shape_name}-{args.reference_layers}l"
        fewer_layers(full, small, args.reference_layers)
        print(f"streaming on the {s['n_layers']}-layer model (the target):")
        for proc in ("none", "compat"):
            results["runs"].append(run_child("streaming", full, proc, base, limit) | {"model": full.name})
        if not args.skip_reference:
            print(f"today's path and streaming on the same shapes with {args.reference_layers} layer(s):")
            for proc in ("none", "compat"):
                results["runs"].append(run_child("bridge", small, proc, base, limit) | {"model": small.name})
                results["runs"].append(run_child("streaming", small, proc, base, limit) | {"model": small.name})
        if not args.skip_space_factors:
            print("the whole extract rule (streaming, + token-space factors of W_E, + save), the target:")
            results["rule"] = {proc: run_child("streaming", full, proc, base, limit, space_factors=True) | {"model": full.name}
                               for proc in ("none", "compat")}
    finally:
        for p in RUNNING:
            p.kill()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)

    ok = True
    print(f"\n{'path':10s} {'proc':6s} {'model':24s} {'peak GiB':>9s} {'f32 out GiB':>11s} {'peak/out':>9s} {'extract s':>9s}")
    for r in results["runs"]:
        if "peak" not in r:
            note = f"killed above {r['killed_at'] / GIB:.1f} GiB" if "killed_at" in r else "FAILED"
            print(f"{r['role']:10s} {r['processing']:6s} {r.get('model', ''):24s} {note}")
            ok = ok and r["role"] != "streaming"
            continue
        r["ratio"] = r["peak"] / r["extracted_float32_bytes"]
        print(f"{r['role']:10s} {r['processing']:6s} {r['model']:24s} {r['peak'] / GIB:9.2f} "
              f"{r['extracted_float32_bytes'] / GIB:11.2f} {r['ratio']:9.2f} {r['extract_s']:9.1f}")
    print()
    for proc, r in (results.get("rule") or {}).items():
        # the target: the extract rule's peak against the bytes it writes (the float32 weights and
        # the float64 token-space factors); beside it, against the float32 weights alone
        if "peak" not in r:
            print(f"extract rule, {proc}: " + (f"killed above {r['killed_at'] / GIB:.1f} GiB" if "killed_at" in r else "FAILED"))
            ok = False
            continue
        r["ratio"] = r["peak"] / r["shard_bytes"]
        met = r["ratio"] <= TARGET
        ok = ok and (met or args.quick)  # at quick sizes the ~0.55 GiB of imports dominate
        verdict = "met" if met else "NOT met" if not args.quick else "not met; the target applies at full size"
        print(f"target, extract rule, {proc}: peak RSS {r['peak'] / GIB:.2f} GiB / shard {r['shard_bytes'] / GIB:.2f} GiB "
              f"= {r['ratio']:.2f} (<= {TARGET}: {verdict}); / float32 weights {r['extracted_float32_bytes'] / GIB:.2f} GiB = "
              f"{r['peak'] / r['extracted_float32_bytes']:.2f}; imports {r['rss_after_imports'] / GIB:.2f} GiB")
        print(f"    peak after extraction {r['peak_after_extract'] / GIB:.2f} GiB, after token-space factors "
              f"{r['peak_after_space_factors'] / GIB:.2f} GiB, after save {r['peak'] / GIB:.2f} GiB; time: extract "
              f"{r['extract_s']:.0f} s, token-space factors {r['space_factors_s']:.0f} s ({r.get('space_factors_cpu_s') or 0:.0f} s CPU), "
              f"save {r['save_s']:.0f} s, total {r['total_s']:.0f} s")
    for proc in ("none", "compat"):
        ref = [r for r in results["runs"] if r["role"] == "bridge" and r["processing"] == proc]
        ours = [r for r in results["runs"] if r["role"] == "streaming" and r["processing"] == proc
                and r.get("model", "").endswith(f"-{args.reference_layers}l")]
        if ref and ours and "peak" in ours[0]:
            if "peak" in ref[0]:
                print(f"same model ({args.reference_layers} layer(s)), {proc}: streaming / today's path peak RSS = "
                      f"{ours[0]['peak'] / ref[0]['peak']:.3f} ({ours[0]['peak'] / GIB:.2f} vs {ref[0]['peak'] / GIB:.2f} GiB)")
            elif "killed_at" in ref[0]:
                print(f"same model ({args.reference_layers} layer(s)), {proc}: streaming / today's path peak RSS < "
                      f"{ours[0]['peak'] / ref[0]['killed_at']:.3f} (today's path killed above {ref[0]['killed_at'] / GIB:.1f} GiB)")
    out = args.json or ROOT / "benchmarks" / "results" / f"extract-memory-{socket.gethostname()}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nresults: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
