"""The pipeline's own training runs (data, reproducibility, resumable segments, loss falls)
and the formation analysis of the report on synthetic curves. The config that turns a run
into a model with checkpoints is tested in test_config.py."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch
import yaml

from compatlas.behaviour import formation as fm
from compatlas.models.training import induction_batch, train_segment
from compatlas.plan.config import validate_config


def _demo_spec() -> dict:
    """The default demo run's training spec, defaults filled in."""
    return validate_config(yaml.safe_load(open("config/config.yaml")))["training"]["induction-2l"]


SPEC = {"n_layers": 2, "n_heads": 2, "d_head": 8, "d_vocab": 32, "seq_len": 24, "batch_size": 8, "lr": 3e-3,
        "weight_decay": 0.01, "seed": 0, "min_span": 4, "max_span": 8, "architecture": "llama"}


def test_repeat_batch_repeats_a_span_of_varying_period_and_is_seeded():
    x = induction_batch(SPEC, 7)
    assert x.shape == (8, 25) and (x[:, 0] == 0).all() and (x[:, 1:] > 0).all() and (x < 32).all()
    assert torch.equal(x, induction_batch(SPEC, 7)) and not torch.equal(x, induction_batch(SPEC, 8))
    periods = set()
    for row in x[:, 1:]:  # the smallest period the tail has, from a start before it
        found = [(k, s) for k in range(4, 9) for s in range(k)
                 if torch.equal(row[s + k:], row[s:len(row) - k])]
        assert found, row
        periods.add(found[0][0])
    assert len(periods) > 1  # no single offset predicts every sequence


def test_copy_batch_copies_a_span_and_is_seeded():
    spec = dict(SPEC, data="copy")
    x = induction_batch(spec, 7)
    assert x.shape == (8, 25) and (x[:, 0] == 0).all() and (x[:, 1:] > 0).all() and (x < 32).all()
    assert torch.equal(x, induction_batch(spec, 7)) and not torch.equal(x, induction_batch(SPEC, 7))
    for row in x[:, 1:]:  # some span of >= min_span tokens occurs twice
        assert any(torch.equal(row[s:s + 4], row[d:d + 4]) for s in range(24) for d in range(s + 4, 21))


def test_training_is_reproducible_and_segments_resume_exactly(tmp_path):
    one = train_segment(SPEC, 30, None, tmp_path / "a")
    again = train_segment(SPEC, 30, None, tmp_path / "b")
    assert one["loss"].to_list() == again["loss"].to_list()  # same loss curve twice
    first = train_segment(SPEC, 12, None, tmp_path / "c12")
    rest = train_segment(SPEC, 30, tmp_path / "c12", tmp_path / "c30")
    assert first["step"].to_list() + rest["step"].to_list() == list(range(1, 31))
    assert first["loss"].to_list() + rest["loss"].to_list() == one["loss"].to_list()  # bitwise
    a, b = torch.load(tmp_path / "a" / "state.pt"), torch.load(tmp_path / "c30" / "state.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert (tmp_path / "c30" / "hf_model" / "config.json").is_file()


def test_a_run_does_not_depend_on_the_threads_torch_is_given(tmp_path):
    """Jobs get different core counts (a laptop, a Slurm node); training pins one thread, so
    the losses are bitwise the same, and the caller's thread count is restored."""
    spec = _demo_spec()
    before = torch.get_num_threads()
    losses = []
    try:
        for n, threads in enumerate((1, 4)):
            torch.set_num_threads(threads)
            losses.append(train_segment(spec, 20, None, tmp_path / str(n))["loss"].to_list())
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    assert losses[0] == losses[1]


TRAIN_AND_HASH = """
import hashlib, sys, tempfile
from pathlib import Path
if sys.argv[1] == "pinned":
    from compatlas.runtime import pin_cpu_kernels
    pin_cpu_kernels()
import torch
from compatlas.models.training import train_segment
spec = {spec!r}
with tempfile.TemporaryDirectory() as d:
    train_segment(spec, 40, None, Path(d))
    state = torch.load(Path(d) / "state.pt", weights_only=True)["model"]
print(torch.backends.cpu.get_cpu_capability(), hashlib.sha256(b"".join(v.numpy().tobytes() for _, v in sorted(state.items()))).hexdigest())
"""


def _train_in_a_process(tmp_path, pinned: bool, capability: str) -> tuple[str, str]:
    """(torch's CPU capability, sha256 of the weights) after 40 steps of the default recipe, trained
    in a fresh process whose environment asks torch for ``capability``'s kernels."""
    import os
    import subprocess
    import sys

    script = tmp_path / "train_and_hash.py"
    script.write_text(TRAIN_AND_HASH.format(spec=_demo_spec()))
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    out = subprocess.run([sys.executable, str(script), "pinned" if pinned else "native"], env=env | {"ATEN_CPU_CAPABILITY": capability},
                         capture_output=True, text=True, check=True, timeout=600)
    cap, digest = out.stdout.split()[-2:]
    return cap, digest


def test_pinned_training_does_not_depend_on_the_cpus_kernels(tmp_path):
    """torch picks its vector kernels by the CPU's instructions, and they round differently: 40
    steps of the default recipe on the scalar kernels (what a CPU without AVX2 gets) and on the AVX2
    ones end in other weights. Training pins AVX2 (compatlas.runtime.pin_cpu_kernels), so a run asking
    for either gives the same bits: the run of a machine with AVX-512 is that of one without."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip(f"this CPU's torch kernels are {torch.backends.cpu.get_cpu_capability()}, not x86-64 with AVX2: "
                    "the pin (AVX2 kernels) cannot be taken here")
    native = {cap: _train_in_a_process(tmp_path, False, cap) for cap in ("default", "avx2")}
    assert native["default"][0] == "DEFAULT" and native["avx2"][0] == "AVX2"
    assert native["default"][1] != native["avx2"][1], "the scalar and AVX2 kernels trained the same bits: nothing to pin"
    pinned = {cap: _train_in_a_process(tmp_path, True, cap) for cap in ("default", "avx512")}
    assert pinned["default"] == pinned["avx512"] == ("AVX2", native["avx2"][1])


def test_mlps_stay_zero_attention_only(tmp_path):
    train_segment(SPEC, 5, None, tmp_path / "m")
    state = torch.load(tmp_path / "m" / "state.pt")["model"]
    mlp = [v for k, v in state.items() if ".mlp." in k]
    assert mlp and all((v == 0).all() for v in mlp)


@pytest.mark.parametrize("n_layers", [1, 3])
def test_one_and_three_layer_runs_train_and_load_through_the_bridge(tmp_path, n_layers):
    from compatlas.behaviour.induction import TokenSet, head_attention_scores
    from compatlas.models.loading import boot

    spec = dict(SPEC, n_layers=n_layers)
    train_segment(spec, 3, None, tmp_path / "m")
    bridge, _ = boot({"source": {"kind": "local", "path": str(tmp_path / "m" / "hf_model")}}, None, tmp_path / "m")
    assert bridge.cfg.n_layers == n_layers
    s = head_attention_scores(bridge, TokenSet(pool=torch.arange(1, 32), bos=0), sequences=2, length=6)
    assert s.height == n_layers * spec["n_heads"]


def test_short_training_lowers_the_loss(tmp_path):
    """Tokens are uniform, so a model that ignores the context cannot beat ln(d_vocab); after
    300 steps the loss is below it: the model already uses the copies."""
    spec = dict(SPEC, batch_size=16)
    loss = train_segment(spec, 300, None, tmp_path / "s")["loss"].to_numpy()
    uniform = np.log(spec["d_vocab"])
    assert loss[:5].mean() > uniform - 0.01
    assert loss[-30:].mean() < uniform - 0.02, (loss[:5].mean(), loss[-30:].mean(), uniform)


def test_default_run_forms_a_previous_token_and_an_induction_head(tmp_path):
    """The default demo run's recipe, trained here: at step 150 no head does either job; by
    step 500 a layer-0 head attends one token back and both layer-1 heads attend to the
    token after the current token's earlier occurrence (the pipeline's own head scores,
    read through the bridge), and the loss has fallen with them. At step 800 the circuit's K edge
    is the top K edge by exact patching and by eap_attn."""
    from compatlas.behaviour.induction import TokenSet, head_attention_scores
    from compatlas.models.loading import boot

    spec = _demo_spec()
    scores, losses = {}, {}
    previous = None
    for step in (150, 500):
        losses[step] = train_segment(spec, step, previous, tmp_path / f"s{step}")["loss"].tail(20).mean()
        previous = tmp_path / f"s{step}"
        bridge, _ = boot({"source": {"kind": "local", "path": str(previous / "hf_model")}}, None, previous)
        s = head_attention_scores(bridge, TokenSet(pool=torch.arange(1, spec["d_vocab"]), bos=0), sequences=16, length=12)
        scores[step] = s.sort(["layer", "head"])
    early, late = scores[150], scores[500]
    assert early["prev_token_mean"].max() < 0.3 and early["induction_mean"].max() < 0.3, early
    l0, l1 = late.filter(pl.col("layer") == 0), late.filter(pl.col("layer") == 1)
    assert l0["prev_token_mean"].max() > 0.4, late
    assert l1["induction_mean"].min() > 0.7, late
    assert losses[500] < losses[150] - 2.0, losses

    # The last checkpoint (800): a K edge from the previous-token head into an induction head
    # carries the task. Exact patching and eap_attn rank it first on three sequence sets;
    # plain EAP, whose gradient the saturated attention flattens, does not reliably
    # (docs/edge_attribution.md).
    from compatlas.function.edge_measure import attribute_edges

    train_segment(spec, 800, previous, tmp_path / "s800")
    bridge, _ = boot({"source": {"kind": "local", "path": str(tmp_path / "s800" / "hf_model")}}, None, tmp_path / "s800")
    final = head_attention_scores(bridge, TokenSet(pool=torch.arange(1, spec["d_vocab"]), bos=0), sequences=16, length=12)
    prev_heads = set(final.filter((pl.col("layer") == 0) & (pl.col("prev_token_mean") > 0.4))["head"])
    induction_heads = set(final.filter((pl.col("layer") == 1) & (pl.col("induction_mean") > 0.4))["head"])
    assert prev_heads and induction_heads, final
    edge = {**validate_config(yaml.safe_load(open("config/config.yaml")))["induction"]["edge_attribution"],
            "methods": ["eap", "eap_attn"]}
    eap_first = 0
    for seed in range(3):
        table, _ = attribute_edges(bridge.eval(), TokenSet(pool=torch.arange(1, spec["d_vocab"]), bos=0), edge, seed=seed)
        k = table.filter(pl.col("comp") == "K")

        def top(method: str, column: str) -> tuple[int, int, int]:
            r = k.filter(pl.col("method") == method).sort(pl.col(column).abs(), descending=True).row(0, named=True)
            return r["writer_layer"], r["writer_head"], r["reader_head"]

        circuit = top("eap", "exact")
        assert circuit[0] == 0 and circuit[1] in prev_heads and circuit[2] in induction_heads, (seed, final, k)
        assert top("eap_attn", "score") == circuit, (seed, k)
        eap_first += top("eap", "score") == circuit
    print("plain EAP ranks the circuit edge first on", eap_first, "of 3 sequence sets")


def _sigmoid(steps, at, lo=0.0, hi=1.0):
    return lo + (hi - lo) / (1 + np.exp(-(np.asarray(steps, float) - at) / 30))


STEPS = np.array([0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 400, 500, 600, 800, 1000])


def test_formation_step_is_the_midpoint_crossing():
    f = fm.formation_step(STEPS, _sigmoid(STEPS, 500, 0.05, 0.9))
    assert 450 < f < 550
    assert fm.formation_step(STEPS, np.full(len(STEPS), 0.3)) is None  # never rises


def test_verdicts_tell_tracking_from_early_rise():
    f = 500.0
    curves = pl.DataFrame({
        "metric": ["frobenius"] * len(STEPS) + ["svd_bound"] * len(STEPS),
        "space": ["residual"] * 2 * len(STEPS), "comp": ["K"] * 2 * len(STEPS),
        "step": np.concatenate([STEPS, STEPS]),
        # frobenius: the K-composition puzzle's shape, high early then falls; svd_bound: jumps at the formation
        "score": np.concatenate([np.where(STEPS < 100, 0.9, 0.3) + 0 * STEPS, _sigmoid(STEPS, 500, 0.2, 0.8)]),
    })
    v = {r["metric"]: r for r in fm.verdicts(curves, f).iter_rows(named=True)}
    assert v["frobenius"]["rises_early"] and not v["frobenius"]["tracks"]
    assert v["svd_bound"]["tracks"] and not v["svd_bound"]["rises_early"]
    text = fm.statement(fm.verdicts(curves, f))
    assert "K-composition under svd_bound (residual)" in text.split("Rises early")[0]
    assert "frobenius" in text.split("Rises early")[1]


def test_eventual_heads():
    last = pl.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "induction_mean": [0.1, 0.0, 0.2, 0.7],
                         "prev_token_mean": [0.2, 0.8, 0.9, 0.1]})
    assert fm.eventual_heads(last) == ((1, 1), (0, 1))  # prev head from an earlier layer only


def test_loss_drop_step_finds_the_steepest_fall():
    steps = np.arange(1, 3001)
    loss = 4.1 - 0.4 / (1 + np.exp(-(steps - 2200) / 40)) + 0.01 * np.sin(steps)
    assert abs(fm.loss_drop_step(steps, loss) - 2200) < 100
    assert fm.loss_drop_step(steps, np.full(3000, 4.1)) is None


def test_training_outcome_from_the_views():
    """The per-run analysis as the report runs it (``report.model.load``: its queries of the views,
    then formation.training_outcome) on hand-made views: head 1.1 forms at step 500 (sigmoid),
    0.0 is the previous-token head, the loss falls at the same step, and the pair's svd_bound K
    curve tracks the formation while the frobenius one is high early."""
    import duckdb

    from compatlas.report import queries as q
    from compatlas.report.model import load
    from compatlas.report.training import runs_table

    def training_outcome(con, model):  # the report's own wiring, not a copy of it
        return load(con, model, q.checkpoints(con), None).outcome

    con = duckdb.connect()
    ckpts = [(f"step{s}", int(s)) for s in STEPS]
    con.execute("CREATE TABLE models (model VARCHAR, checkpoint VARCHAR, checkpoint_step BIGINT)")
    con.executemany("INSERT INTO models VALUES ('run', ?, ?)", ckpts)
    ind = _sigmoid(STEPS, 500, 0.02, 0.9)
    rows = []
    for (ck, _), v in zip(ckpts, ind):
        rows += [("run", ck, 0, 0, 0.8, 0.01), ("run", ck, 0, 1, 0.1, 0.02),
                 ("run", ck, 1, 0, 0.0, 0.05), ("run", ck, 1, 1, 0.0, float(v))]
    con.execute("""CREATE TABLE head_scores (model VARCHAR, checkpoint VARCHAR, layer INTEGER, head INTEGER,
                   prev_token_mean DOUBLE, induction_mean DOUBLE)""")
    con.executemany("INSERT INTO head_scores VALUES (?, ?, ?, ?, ?, ?)", rows)
    steps = np.arange(1, 1001)
    con.execute("CREATE TABLE training_loss AS SELECT * FROM (SELECT 'run' AS model, unnest(?) AS step, unnest(?) AS loss)",
                [steps.tolist(), (4.0 - 2.0 / (1 + np.exp(-(steps - 500) / 20))).tolist()])
    comp = []
    for (ck, step) in ckpts:
        comp.append(("run", ck, "svd_bound", "residual", "K", 0, 0, 1, 1, float(_sigmoid(step, 500, 0.3, 0.9))))
        comp.append(("run", ck, "frobenius", "residual", "K", 0, 0, 1, 1, 0.9 if 0 < step < 200 else 0.3))
    con.execute("""CREATE TABLE composition (model VARCHAR, checkpoint VARCHAR, metric VARCHAR, space VARCHAR, comp VARCHAR,
                   writer_layer INTEGER, writer_head INTEGER, reader_layer INTEGER, reader_head INTEGER, score DOUBLE,
                   baseline_gaussian_mean DOUBLE, baseline_spectrum_mean DOUBLE, baseline_spectrum_std DOUBLE)""")
    con.executemany("INSERT INTO composition VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, NULL)", comp)
    t = training_outcome(con, "run")
    assert t.pair == ((1, 1), (0, 0))
    assert 450 < t.formation < 550 and abs(t.drop - 500) < 60 and t.marker == t.formation
    assert set(t.curves["metric"]) == {"svd_bound", "frobenius"} and t.curves.height == 2 * len(STEPS)
    html = runs_table({"run": t}, lambda m: m)
    assert "<td>L1.H1 (0.90)</td>" in html and "<td>L0.H0 (0.80)</td>" in html
    assert "K: svd_bound (residual)" in html and "frobenius" not in html.split("</tr>")[-2]


