# Composition scores for one (model, checkpoint, space, block of layer pairs): every kernel metric
# of the run at once (compatlas.composition.table.score_space: the metrics share the heads' factors
# and core products), one shard per metric for the causal pairs (writer layer < reader layer) and
# one for the null pairs that cannot compose, scored from the same factors. Adding a metric to the
# config adds outputs: every composition job reruns (the new metric plus factors shared with the
# old, which are rewritten identical) and so does what reads them; removing one reruns no
# composition job.


if KERNEL_METRICS_RUN:

    rule composition:
        input:
            unpack(space_moments),
            tensors=WEIGHTS_TENSORS,
            meta=WEIGHTS_META,
        output:
            causal=metric_shards(SHARD, KERNEL_METRICS_RUN),
            null=metric_shards(NULL_SHARD, KERNEL_METRICS_RUN),
        params:
            layers=model_layers,
            blocks=model_blocks,
            settings=composition_job_settings,
            device=setting("device"),
            dtype=setting("dtype"),
        conda:
            "../envs/compatlas.yaml"
        log:
            f"{LOGS}/composition/{{model}}/{{checkpoint}}/{{space}}-{{block}}.log",
        priority: model_priority
        resources:
            mem_mb=4000,
            runtime=30,
        script:
            "../scripts/composition.py"


# pattern_output's shards: the moments rule measured its scores on the model's forward pass
# (compatlas.composition.pattern_output); this job only cuts them into the block's rows.
rule pattern_output:
    input:
        moments=MOMENTS,
        moments_meta=MOMENTS_META,
        meta=WEIGHTS_META,
    output:
        causal=metric_shards(SHARD, ["pattern_output"], space="activation"),
        null=metric_shards(NULL_SHARD, ["pattern_output"], space="activation"),
    params:
        layers=model_layers,
        blocks=model_blocks,
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/composition/{{model}}/{{checkpoint}}/pattern_output-{{block}}.log",
    priority: model_priority
    resources:
        mem_mb=2000,
        runtime=10,
    script:
        "../scripts/pattern_output.py"


# p- and q-values of every causal pair of a model x checkpoint against its null pairs
# (compatlas/composition/calibration.py): all metrics, spaces and blocks at once, one small job. The weights'
# metadata says how many query heads share a KV head (one test where their scores cannot differ).
rule calibrate:
    input:
        causal=model_composition_shards(SHARD),
        null=model_composition_shards(NULL_SHARD),
        meta=WEIGHTS_META,
    output:
        CALIBRATION,
    params:
        stratify=setting("composition", "null_stratify"),
        null_pairs=setting("composition", "null_pairs"),
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/calibrate/{{model}}/{{checkpoint}}.log",
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    script:
        "../scripts/calibrate.py"
