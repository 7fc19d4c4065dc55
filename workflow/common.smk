# Helpers shared by the rules: config validation, the grid, and what each rule reads.
import json
from pathlib import Path

from snakemake.exceptions import WorkflowError

from compatlas.composition import COMPS, METRICS, layer_pairs, n_blocks
from compatlas.config import ConfigError, model_checkpoints, selected_layers, validate_config
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


def extracted_meta(model, checkpoint):
    """Metadata of an extracted model; waits for (and triggers) the extract checkpoint."""
    meta = checkpoints.extract.get(model=model, checkpoint=checkpoint).output.meta
    return json.loads(Path(meta).read_text())


def composition_shards(wildcards):
    """All shards of the grid. The number of layer-pair blocks follows from each model's
    layer count, known once it is extracted (hence the checkpoint)."""
    shards = []
    for model, ckpt in model_checkpoint_pairs():
        entry = config["models"][model]
        try:
            layers = selected_layers(entry, extracted_meta(model, ckpt)["n_layers"], model)
        except ConfigError as e:
            raise WorkflowError(str(e))
        blocks = n_blocks(len(layer_pairs(layers)), config["composition"]["pairs_per_job"])
        # (a line may not start with `checkpoint=` in a .smk file: it is a keyword)
        grid = dict(model=model, checkpoint=ckpt, metric=config["metrics"], space=config["spaces"])
        shards += expand(SHARD, block=range(blocks), **grid)
    return shards


def all_metas(wildcards):
    """Plain paths, not checkpoint lookups: a model added to the config is then a missing
    input of the atlas, which makes Snakemake extract it and re-plan its composition jobs."""
    return [WEIGHTS_META.format(model=m, checkpoint=c) for m, c in model_checkpoint_pairs()]
