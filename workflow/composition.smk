# Composition scores for one (model, checkpoint, metric, space, block of layer pairs): the causal
# pairs (writer layer < reader layer) and, from the same factors, the null pairs that cannot compose.


rule composition:
    input:
        unpack(space_moments),
        tensors=WEIGHTS_TENSORS,
        meta=WEIGHTS_META,
    output:
        causal=SHARD,
        null=NULL_SHARD,
    params:
        layers=model_layers,
        blocks=model_blocks,
        settings=setting("composition"),
        device=setting("device"),
        dtype=setting("dtype"),
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/composition/{{model}}/{{checkpoint}}/{{metric}}-{{space}}-{{block}}.log",
    priority: model_priority
    resources:
        mem_mb=4000,
        runtime=30,
    script:
        "../scripts/composition.py"


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
