# Helpers shared by the rules: config validation, the grid, and what each rule reads.
import os
import sys

from snakemake.exceptions import WorkflowError

from compatlas.composition import METRICS
from compatlas.config import ConfigError, induction_settings, last_checkpoint, model_checkpoints, trained_run, validate_config
from compatlas.token_space import SPACES

# Validate (and fill defaults) before any job is scheduled: one line naming the config file, the
# key and the problem (not this file's line, which a WorkflowError would point at).
try:
    validate_config(config)
except ConfigError as e:
    print(f"{', '.join(map(str, workflow.configfiles)) or 'config'}: {e}", file=sys.stderr)
    raise SystemExit(1)

RESULTS = config["results"]
LOGS = f"{RESULTS}/logs"

WEIGHTS_TENSORS = f"{RESULTS}/weights/{{model}}/{{checkpoint}}/weights.safetensors"
WEIGHTS_META = f"{RESULTS}/weights/{{model}}/{{checkpoint}}/meta.json"
INVARIANCE = f"{RESULTS}/invariance/model={{model}}/checkpoint={{checkpoint}}/invariance.parquet"
INDUCTION_TOKENS = f"{RESULTS}/induction/model={{model}}/checkpoint={{checkpoint}}/tokens.parquet"
HEAD_SCORES = f"{RESULTS}/induction/model={{model}}/checkpoint={{checkpoint}}/heads.parquet"
TRAIN_STATE = f"{RESULTS}/train/{{model}}/{{checkpoint}}/state.pt"
TRAIN_LOSS = f"{RESULTS}/train/{{model}}/{{checkpoint}}/loss.parquet"
SHARD = f"{RESULTS}/composition/model={{model}}/checkpoint={{checkpoint}}/metric={{metric}}/space={{space}}/block={{block}}.parquet"
NULL_SHARD = f"{RESULTS}/composition_null/model={{model}}/checkpoint={{checkpoint}}/metric={{metric}}/space={{space}}/block={{block}}.parquet"
CALIBRATION = f"{RESULTS}/calibration/model={{model}}/checkpoint={{checkpoint}}/pvalues.parquet"


wildcard_constraints:
    model=r"[A-Za-z0-9][A-Za-z0-9_.-]*",
    checkpoint=r"[A-Za-z0-9_.-]+",
    metric="|".join(METRICS),
    space="|".join(SPACES),
    block=r"\d+",


def model_entry(wildcards):
    """The model's config entry as jobs see it: without the checkpoint list, so that adding a
    checkpoint does not change (and rerun) the jobs of the others."""
    return {k: v for k, v in config["models"][wildcards.model].items() if k != "checkpoints"}


def segment_spec(wildcards):
    """What a training segment depends on: the run without its length and schedule."""
    spec = trained_run(config, wildcards.model)
    return {k: v for k, v in spec.items() if k not in ("steps", "schedule", "description", "spaces", "blocks")}


def checkpoint_spec(wildcards):
    specs = model_checkpoints(config["models"][wildcards.model])
    if wildcards.checkpoint not in specs:
        raise WorkflowError(f"model {wildcards.model} has no checkpoint {wildcards.checkpoint!r}")
    return specs[wildcards.checkpoint]


# Below this size (parameters, from the config's dimensions) a job is bound by Python start-up
# rather than arithmetic: it gets one thread, so that two run side by side on two cores.
SMALL_MODEL_PARAMS = 10_000_000


def model_threads(wildcards):
    """Threads of a model's jobs: one for a small model built or trained here, two otherwise (a
    model loaded from the hub, a folder or a GGUF file has no size until it is loaded).
    Slurm profiles set their own (`set-threads`)."""
    src = config["models"][wildcards.model]["source"]
    dims = trained_run(config, wildcards.model) if src["kind"] == "trained" else src
    if src["kind"] not in ("build", "trained"):
        return 2
    d_model = dims["n_heads"] * dims["d_head"]
    params = dims["n_layers"] * 12 * d_model**2 + 2 * dims["d_vocab"] * d_model
    return 1 if params < SMALL_MODEL_PARAMS else 2


def model_checkpoint_pairs():
    """Every (model, checkpoint) of the zoo."""
    return [(m, c) for m, entry in config["models"].items() for c in model_checkpoints(entry)]


def model_blocks(model):
    return config["models"][model].get("blocks", config["composition"]["blocks"])


def model_spaces(model):
    return config["models"][model].get("spaces", config["spaces"])


def grid_shards(path, model, ckpt):
    """``path`` (SHARD or NULL_SHARD) for every metric, space and block of one model x checkpoint.
    The DAG is static (blocks come from the config, not from the model's layer count), so dry
    runs and incremental reruns see every job."""
    # (a line may not start with `checkpoint=` in a .smk file: it is a keyword)
    grid = dict(model=model, checkpoint=ckpt, metric=config["metrics"], space=model_spaces(model))
    return expand(path, block=range(model_blocks(model)), **grid)


def model_composition_shards(path):
    """Input function: ``path`` for every metric, space and block of the job's model x checkpoint."""
    return lambda wc: grid_shards(path, wc.model, wc.checkpoint)


def all_shards(path):
    """Input function: ``path`` of every model x checkpoint x metric x space x block of the grid."""
    return lambda wc: [s for m, c in model_checkpoint_pairs() for s in grid_shards(path, m, c)]


def calibration_shards(wildcards):
    return [CALIBRATION.format(model=m, checkpoint=c) for m, c in model_checkpoint_pairs()]


def invariance_shards(wildcards):
    """The audit characterises a metric on a model, not a training stage: each model's last
    checkpoint only."""
    if not config["invariance"]["enabled"]:
        return []
    return [INVARIANCE.format(model=m, checkpoint=last_checkpoint(e)) for m, e in config["models"].items()]


def previous_train_state(wildcards):
    """The train rule resumes the checkpoint before this one (none for the first)."""
    labels = list(model_checkpoints(config["models"][wildcards.model]))
    i = labels.index(wildcards.checkpoint)
    return [] if i == 0 else [TRAIN_STATE.format(model=wildcards.model, checkpoint=labels[i - 1])]


def extract_inputs(wildcards):
    """A trained model's checkpoint is made by the train rule; other sources need nothing."""
    if trained_run(config, wildcards.model) is None:
        return []
    return [TRAIN_STATE.format(**wildcards)]


def training_loss_shards(wildcards):
    return [TRAIN_LOSS.format(model=m, checkpoint=c) for m, c in model_checkpoint_pairs()
            if trained_run(config, m) is not None]


def all_metas(wildcards):
    return [WEIGHTS_META.format(model=m, checkpoint=c) for m, c in model_checkpoint_pairs()]


def induction_enabled(model):
    return induction_settings(config, model)["enabled"]


def induction_shards(path):
    """The induction rule's output `path` for every (model, checkpoint) with induction enabled."""
    return [path.format(model=m, checkpoint=c) for m, c in model_checkpoint_pairs() if induction_enabled(m)]


# One run at a time on a results folder (compatlas/runlock.py): Snakemake's own lock covers
# only its working directory. Taken when jobs are about to run (onstart: never for dry runs nor
# inside jobs), given back when the run ends; --nolock skips it, as it skips Snakemake's.
_RUN_LOCK = {}


onstart:
    if workflow.is_main_process and workflow.execution_settings.lock:
        from compatlas import runlock

        try:
            _RUN_LOCK["lock"] = runlock.acquire(RESULTS, os.getcwd())
        except runlock.RunLockError as e:
            print(f"compatlas: {e}", file=sys.stderr)
            raise SystemExit(1)


onsuccess:
    if "lock" in _RUN_LOCK:
        _RUN_LOCK.pop("lock").release()


onerror:
    if "lock" in _RUN_LOCK:
        _RUN_LOCK.pop("lock").release()
