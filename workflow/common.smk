# Helpers shared by the rules: the plan (the config validated and resolved once), the grid, and
# what each rule reads. Rules take every setting from PLAN, never from `config`; the values they
# hand a job as params are thawed to the plain lists and dicts the config holds, since Snakemake
# reruns a job whose params' repr changed.
import os
import sys

from snakemake.exceptions import WorkflowError

from compatlas.plan.config import ConfigError, load_config_file
from compatlas.plan import build_plan, thaw
from compatlas.plan.edge_jobs import attribution_jobs, exact_jobs
from compatlas.storage import remove_leftover_temps
from compatlas.vocab import ACTIVATION_ONLY_METRICS, EXACT_PATCHING_KEYS, METRICS, SPACES

# Validate and plan before any job is scheduled: one line naming the config file, the key and the
# problem (not this file's line, which a WorkflowError would point at). `config` is left as the
# user wrote it.
# The main process also asks the hub (once per repository) whether it has every hub source and
# revision; a job's own Snakemake process (on a cluster) does not ask again.
try:
    if workflow.is_main_process:  # Snakemake's own YAML loader keeps the last of two equal keys
        for _file in workflow.configfiles:
            load_config_file(_file)
    PLAN = build_plan(config, check_hub=workflow.is_main_process)
except ConfigError as e:
    print(f"{', '.join(map(str, workflow.configfiles)) or 'config'}: {e}", file=sys.stderr)
    raise SystemExit(1)
for note in PLAN.notes:
    print(f"note: {note}", file=sys.stderr)

RESULTS = PLAN.results
LOGS = f"{RESULTS}/logs"
# A dry run (-n) writes nothing. While the Snakefile is parsed Snakemake tells it only through its
# output settings (workflow.dryrun asks the executor, which is chosen after the parse).
DRYRUN = bool(getattr(workflow.output_settings, "dryrun", False)) or workflow.dryrun
# the run's metrics that the composition kernel scores from the weights, one job per space for all
KERNEL_METRICS_RUN = [m for m in PLAN.metrics if m not in ACTIVATION_ONLY_METRICS]

WEIGHTS_TENSORS = f"{RESULTS}/weights/{{model}}/{{checkpoint}}/weights.safetensors"
WEIGHTS_META = f"{RESULTS}/weights/{{model}}/{{checkpoint}}/meta.json"
INVARIANCE = f"{RESULTS}/invariance/model={{model}}/checkpoint={{checkpoint}}/invariance.parquet"
INDUCTION_TOKENS = f"{RESULTS}/induction/model={{model}}/checkpoint={{checkpoint}}/tokens.parquet"
HEAD_SCORES = f"{RESULTS}/induction/model={{model}}/checkpoint={{checkpoint}}/heads.parquet"
EDGE_ATTRIBUTION = f"{RESULTS}/edge_attribution/model={{model}}/checkpoint={{checkpoint}}/edges.parquet"
EDGE_SHARE = f"{RESULTS}/edge_sums/model={{model}}/checkpoint={{checkpoint}}/share={{share}}.parquet"
EXACT_SHARE = f"{RESULTS}/exact_values/model={{model}}/checkpoint={{checkpoint}}/share={{share}}.parquet"
TRAIN_STATE = f"{RESULTS}/train/{{model}}/{{checkpoint}}/state.pt"
TRAIN_LOSS = f"{RESULTS}/train/{{model}}/{{checkpoint}}/loss.parquet"
SHARD = f"{RESULTS}/composition/model={{model}}/checkpoint={{checkpoint}}/metric={{metric}}/space={{space}}/block={{block}}.parquet"
NULL_SHARD = f"{RESULTS}/composition_null/model={{model}}/checkpoint={{checkpoint}}/metric={{metric}}/space={{space}}/block={{block}}.parquet"
CALIBRATION = f"{RESULTS}/calibration/model={{model}}/checkpoint={{checkpoint}}/pvalues.parquet"
MOMENTS = f"{RESULTS}/moments/{{model}}/{{checkpoint}}/moments.safetensors"
MOMENTS_META = f"{RESULTS}/moments/{{model}}/{{checkpoint}}/moments.json"


wildcard_constraints:
    model=r"[A-Za-z0-9][A-Za-z0-9_.-]*",
    checkpoint=r"[A-Za-z0-9_.-]+",
    metric="|".join(METRICS),
    space="|".join(SPACES),
    block=r"\d+",
    share=r"\d+",


# Keys of a model's entry that say how it is scored or measured, not how it is loaded: each
# reaches its jobs as a param of its own, so changing one reruns those jobs, not the extraction.
NOT_LOADING_KEYS = ("description", "spaces", "blocks", "activation", "induction")


def model_entry(wildcards):
    """The model's config entry as loading jobs see it: without the checkpoint list (adding a
    checkpoint does not change, and rerun, the jobs of the others) nor the scoring settings."""
    entry = PLAN.models[wildcards.model].entry
    return thaw({k: v for k, v in entry.items() if k not in NOT_LOADING_KEYS})


def segment_spec(wildcards):
    """What a training segment depends on: the run without its length and schedule."""
    return PLAN.models[wildcards.model].segment_spec()


def checkpoint_plan(wildcards):
    try:
        return PLAN.models[wildcards.model].checkpoint(wildcards.checkpoint)
    except KeyError as e:
        raise WorkflowError(f"model {wildcards.model} has no checkpoint {wildcards.checkpoint!r}") from e


def checkpoint_spec(wildcards):
    """The checkpoint as the loaders take it (label, step, tokens, what selects its revision)."""
    return checkpoint_plan(wildcards).spec()


def model_layers(wildcards):
    """The config's [first, last] layers of the model, or None for all (jobs learn the size from
    the weights: a hub model's is not known before it is loaded)."""
    return thaw(PLAN.models[wildcards.model].layer_range)


# Every job runs on one thread (the rules set none). Two one-thread jobs side by side do more
# than one two-thread job: start-up, loading and bookkeeping are serial, and even a matrix
# product gains only 1.5x from a second core (benchmarks/README.md, "Threads"). A rule gets more
# with `--set-threads RULE=N` (a large model alone on a big node); the Slurm profiles set theirs.

# Below this size (parameters, from the config's dimensions) a model's jobs are short, bound by
# Python start-up rather than arithmetic: they are scheduled after the larger models' jobs.
SMALL_MODEL_PARAMS = 10_000_000


def model_priority(wildcards):
    """A large model's jobs start first: they are the run's longest chain, and the small models'
    many short jobs fill the cores around them. A model loaded from the hub, a folder or a GGUF
    file counts as large (its size is known only once loaded)."""
    params = PLAN.models[wildcards.model].parameters
    return 0 if params is not None and params < SMALL_MODEL_PARAMS else 1


def model_spaces(wildcards):
    return thaw(PLAN.models[wildcards.model].spaces)


def model_blocks(wildcards):
    return PLAN.models[wildcards.model].blocks


def model_induction(wildcards):
    """The induction settings with the model's overrides applied, less edge attribution's (its own
    jobs read those: a change to them must not rerun the sweeps, head scores and ablation)."""
    return {k: v for k, v in thaw(PLAN.models[wildcards.model].induction).items() if k != "edge_attribution"}


def setting(section, key=None):
    """A global setting of the validated config (defaults filled), as a plain value for params."""
    value = PLAN.config[section]
    return thaw(value if key is None else value[key])


def composition_job_settings(wildcards):
    """What a composition job reads of the composition section: a change to the others (the
    blocks' rule, the FDR, the null's stratification) reruns no scoring."""
    c = PLAN.config["composition"]
    return thaw({k: c[k] for k in ("baseline_samples", "seed", "max_condition")})


def grid_shards(path, model, ckpt):
    """``path`` (SHARD or NULL_SHARD) for every metric, space and block of one model x checkpoint.
    The DAG is static (blocks come from the config, not from the model's layer count), so dry
    runs and incremental reruns see every job."""
    m = PLAN.models[model]
    # the model's (metric, space) cells: pattern_output is scored in the activation space only
    return [path.format(model=model, checkpoint=ckpt, metric=metric, space=space, block=b)
            for metric, space in m.cells(PLAN.metrics) for b in range(m.blocks)]


def metric_shards(path, metrics, **fixed):
    """``path`` (SHARD or NULL_SHARD) of each of ``metrics``, its other wildcards left for the job
    (a composition job's outputs: one shard per metric)."""
    return expand(path, metric=metrics, **fixed, allow_missing=True)


def model_composition_shards(path):
    """Input function: ``path`` for every metric, space and block of the job's model x checkpoint."""
    return lambda wc: grid_shards(path, wc.model, wc.checkpoint)


def all_shards(path):
    """Input function: ``path`` of every model x checkpoint x metric x space x block of the grid."""
    return lambda wc: [s for m, c in PLAN.pairs() for s in grid_shards(path, m.name, c.label)]


def calibration_shards(wildcards):
    return [CALIBRATION.format(model=m.name, checkpoint=c.label) for m, c in PLAN.pairs()]


def invariance_shards(wildcards):
    """The audit characterises a metric on a model, not a training stage: each model's last
    checkpoint only."""
    if not PLAN.config["invariance"]["enabled"]:
        return []
    return [INVARIANCE.format(model=m.name, checkpoint=m.last.label) for m in PLAN.models.values()]


def atlas_input_files(wildcards=None):
    """Every file the atlas rule reads, by input name (the rule unpacks it; ``atlas_inputs`` flattens it)."""
    return dict(shards=all_shards(SHARD)(wildcards), null_shards=all_shards(NULL_SHARD)(wildcards),
                calibration=calibration_shards(wildcards), invariance=invariance_shards(wildcards),
                metric_audit=f"{RESULTS}/metric_audit/metric_audit.parquet", metas=all_metas(wildcards),
                induction_tokens=induction_shards(INDUCTION_TOKENS), head_scores=induction_shards(HEAD_SCORES),
                edge_attribution=edge_attribution_shards(wildcards), training_loss=training_loss_shards(wildcards))


def atlas_inputs():
    """Every file the atlas rule reads, as one list."""
    return [f for files in atlas_input_files().values() for f in ([files] if isinstance(files, str) else files)]


def previous_train_state(wildcards):
    """The train rule resumes the checkpoint before this one (none for the first)."""
    previous = PLAN.models[wildcards.model].previous(wildcards.checkpoint)
    return [] if previous is None else [TRAIN_STATE.format(model=wildcards.model, checkpoint=previous.label)]


def extract_inputs(wildcards):
    """A trained model's checkpoint is made by the train rule; other sources need nothing."""
    if PLAN.models[wildcards.model].training is None:
        return []
    return [TRAIN_STATE.format(**wildcards)]


def training_loss_shards(wildcards):
    return [TRAIN_LOSS.format(model=m.name, checkpoint=c.label) for m, c in PLAN.pairs() if m.training is not None]


def all_metas(wildcards):
    return [WEIGHTS_META.format(model=m.name, checkpoint=c.label) for m, c in PLAN.pairs()]


def induction_shards(path):
    """The induction rule's output `path` for every (model, checkpoint) with induction enabled."""
    return [path.format(model=m.name, checkpoint=c.label) for m, c in PLAN.pairs() if m.induction["enabled"]]


def edge_attribution_shards(wildcards):
    """The edge attribution shard of every (model, checkpoint) with induction and edge attribution enabled."""
    return [EDGE_ATTRIBUTION.format(model=m.name, checkpoint=c.label) for m, c in PLAN.pairs()
            if m.induction["enabled"] and m.induction["edge_attribution"]["enabled"]]


def edge_stratify_shards(wildcards):
    """The composition shards (every block) whose scores exact patching's sample is stratified
    over: the run's first metric in the model's first space (frobenius x residual by default).
    Ancient: a remade shard (a cancelled composition job rerun) does not rerun the costly edge
    attribution; new weights do, through meta.json."""
    m = PLAN.models[wildcards.model]
    return [ancient(p) for p in expand(SHARD, model=wildcards.model, checkpoint=wildcards.checkpoint,
                                       metric=PLAN.metrics[0], space=m.spaces[0], block=range(m.blocks))]


def space_moments(wildcards):
    """A composition job in the activation space reads its model x checkpoint's moments; other
    spaces read none (named inputs: an empty dict)."""
    if wildcards.space != "activation":
        return {}
    return {"moments": MOMENTS.format(**wildcards), "moments_meta": MOMENTS_META.format(**wildcards)}


def model_activation(wildcards):
    """The text sample of the model's moments (its override of the activation section applied)."""
    return thaw(PLAN.models[wildcards.model].activation)


def model_forward_settings(wildcards):
    """What a moments job reads of the induction settings: how the model is booted and BOS."""
    ind = PLAN.models[wildcards.model].induction
    return thaw({k: ind[k] for k in ("pool", "prepend_bos", "dtype", "device_map")})


def model_edge_settings(wildcards):
    """What an edge attribution job reads of the model's induction settings (so that a change to
    the sweep's settings does not rerun it)."""
    ind = PLAN.models[wildcards.model].induction
    return thaw({k: ind[k] for k in ("pool", "prepend_bos", "seed", "dtype", "device_map", "cpu_matmul", "edge_attribution")})


def model_share_settings(wildcards):
    """What an attribution job over a share of the sequences reads of the model's induction settings."""
    settings = model_edge_settings(wildcards)
    settings["edge_attribution"] = {k: v for k, v in settings["edge_attribution"].items() if k not in EXACT_PATCHING_KEYS}
    return settings


def edge_share_shards(wildcards):
    """The attribution jobs' shards an edge attribution job merges: one per share of the
    sequences where ``induction.edge_attribution.jobs`` splits them, none where one job runs all."""
    jobs = attribution_jobs(PLAN.models[wildcards.model].induction["edge_attribution"])
    return expand(EDGE_SHARE, model=wildcards.model, checkpoint=wildcards.checkpoint, share=range(jobs))


def exact_share_shards(wildcards):
    """The exact-patching jobs' shards an edge attribution job stacks: one per share of the exact
    sequences where the attribution is split (compatlas.function.exact_shares), none otherwise."""
    jobs = exact_jobs(PLAN.models[wildcards.model].induction["edge_attribution"])
    return expand(EXACT_SHARE, model=wildcards.model, checkpoint=wildcards.checkpoint, share=range(jobs))


def report_config():
    """The config as the report's footer prints it: the settings as validated (defaults filled)
    and the names of the models, training runs' included."""
    return {**thaw(PLAN.config), "models": list(PLAN.models)}


STALE = (1, 1)  # (atime, mtime): 1970-01-01 00:00:01, what stale_atlas dates the atlas to (atlas.smk says why)


def stale_atlas(atlas, why, doing, will):
    """Date the atlas to STALE, so that this run rebuilds it, saying why; a dry run writes
    nothing under results/ (dating it there had planned a rebuild for a later run that needed
    none): it only says what a run will do, which its plan then lacks."""
    if DRYRUN:
        print(f"compatlas: {why}: a run {will} (this dry run writes nothing, and its plan does not show that)",
              file=sys.stderr)
    else:
        print(f"compatlas: {why}: {doing}", file=sys.stderr)
        os.utime(atlas, STALE)


# One run at a time on a results folder (compatlas/runlock.py): Snakemake's own lock covers
# only its working directory. Taken when jobs are about to run (onstart: never for dry runs nor
# inside jobs), given back when the run ends; --nolock skips it, as it skips Snakemake's.
# A local run also starts the job server (compatlas/worker/): each job's script runs in a fork
# of one process that has imported torch and the package, so start-up is paid once per run, not
# per job. Not on a cluster (a job's node and allocation are its own), nor with COMPATLAS_WORKER=off.
# Every run gives its jobs glibc's allocator settings (compatlas.runtime.JOB_MALLOC).
_RUN = {}


onstart:
    if workflow.is_main_process and workflow.execution_settings.lock:
        from compatlas import runlock

        try:
            _RUN["lock"] = runlock.acquire(RESULTS, os.getcwd())
        except runlock.RunLockError as e:
            print(f"compatlas: {e}", file=sys.stderr)
            raise SystemExit(1)
        # the jobs inherit the run's lock and token: a job whose run no longer holds the lock (one
        # left behind by a killed run) has its writes refused (runlock.check_current)
        os.environ.update(_RUN["lock"].job_environ())
        # holding the lock, before any job: every temporary file under results/ is a killed job's
        gone = remove_leftover_temps(RESULTS)
        if gone:
            print(f"compatlas: removed {len(gone)} temporary files left by killed jobs (e.g. {gone[0]})",
                  file=sys.stderr)
    if workflow.is_main_process:
        from compatlas.runtime import job_environment

        _RUN["environ"] = job_environment(os.environ)  # glibc's allocator settings, unless the user set theirs
        os.environ.update(_RUN["environ"])  # before the job server and the first job start
    if workflow.is_main_process and workflow.local_exec:
        from compatlas import worker

        _RUN["worker"] = worker.start(os.getcwd(), os.path.join(workflow.basedir, "scripts"),
                                      ".snakemake/log/compatlas-worker.log")


def _end_run():
    for name in _RUN.pop("environ", {}):
        os.environ.pop(name, None)
    if "worker" in _RUN and _RUN["worker"] is not None:
        _RUN.pop("worker").stop()
    if "lock" in _RUN:
        from compatlas import runlock

        _RUN.pop("lock").release()
        for name in (runlock.LOCK_ENV, runlock.TOKEN_ENV):
            os.environ.pop(name, None)


onsuccess:
    _end_run()


onerror:
    _end_run()
