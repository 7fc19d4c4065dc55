# Helpers shared by the rules: config validation, the grid, and what each rule reads.
from snakemake.exceptions import WorkflowError

from compatlas.composition import METRICS
from compatlas.config import ConfigError, induction_settings, model_checkpoints, validate_config
from compatlas.token_space import SPACES

# Validate (and fill defaults) before any job is scheduled: one line naming key and problem.
try:
    validate_config(config)
except ConfigError as e:
    raise WorkflowError(str(e))

RESULTS = config["results"]
LOGS = f"{RESULTS}/logs"

WEIGHTS_TENSORS = f"{RESULTS}/weights/{{model}}/{{checkpoint}}/weights.safetensors"
WEIGHTS_META = f"{RESULTS}/weights/{{model}}/{{checkpoint}}/meta.json"
INVARIANCE = f"{RESULTS}/invariance/model={{model}}/checkpoint={{checkpoint}}/invariance.parquet"
INDUCTION_TOKENS = f"{RESULTS}/induction/model={{model}}/checkpoint={{checkpoint}}/tokens.parquet"
HEAD_SCORES = f"{RESULTS}/induction/model={{model}}/checkpoint={{checkpoint}}/heads.parquet"
SHARD = f"{RESULTS}/composition/model={{model}}/checkpoint={{checkpoint}}/metric={{metric}}/space={{space}}/block={{block}}.parquet"


wildcard_constraints:
    model=r"[A-Za-z0-9][A-Za-z0-9_.-]*",
    checkpoint=r"[A-Za-z0-9_.-]+",
    metric="|".join(METRICS),
    space="|".join(SPACES),
    block=r"\d+",


def model_entry(wildcards):
    return config["models"][wildcards.model]


def checkpoint_spec(wildcards):
    specs = model_checkpoints(config["models"][wildcards.model])
    if wildcards.checkpoint not in specs:
        raise WorkflowError(f"model {wildcards.model} has no checkpoint {wildcards.checkpoint!r}")
    return specs[wildcards.checkpoint]


def model_checkpoint_pairs():
    """Every (model, checkpoint) of the zoo."""
    return [(m, c) for m, entry in config["models"].items() for c in model_checkpoints(entry)]


def model_blocks(model):
    return config["models"][model].get("blocks", config["composition"]["blocks"])


def composition_shards(wildcards):
    """Every shard of the grid. The DAG is static (blocks come from the config, not from
    the model's layer count), so dry runs and incremental reruns see every job."""
    shards = []
    for model, ckpt in model_checkpoint_pairs():
        # (a line may not start with `checkpoint=` in a .smk file: it is a keyword)
        grid = dict(model=model, checkpoint=ckpt, metric=config["metrics"], space=config["spaces"])
        shards += expand(SHARD, block=range(model_blocks(model)), **grid)
    return shards


def invariance_shards(wildcards):
    if not config["invariance"]["enabled"]:
        return []
    return [INVARIANCE.format(model=m, checkpoint=c) for m, c in model_checkpoint_pairs()]


def all_metas(wildcards):
    return [WEIGHTS_META.format(model=m, checkpoint=c) for m, c in model_checkpoint_pairs()]


def induction_enabled(model):
    return induction_settings(config, model)["enabled"]


def induction_shards(path):
    """The induction rule's output `path` for every (model, checkpoint) with induction enabled."""
    return [path.format(model=m, checkpoint=c) for m, c in model_checkpoint_pairs() if induction_enabled(m)]
