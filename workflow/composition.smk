# Composition scores for one (model, checkpoint, metric, space, block of layer pairs).


rule composition:
    input:
        tensors=WEIGHTS_TENSORS,
        meta=WEIGHTS_META,
    output:
        SHARD,
    params:
        layers=lambda wc: config["models"][wc.model].get("layers"),
        blocks=lambda wc: model_blocks(wc.model),
        settings=config["composition"],
        device=config["device"],
        dtype=config["dtype"],
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/composition/{{model}}/{{checkpoint}}/{{metric}}-{{space}}-{{block}}.log",
    threads: 2
    resources:
        mem_mb=4000,
        runtime=30,
    script:
        "../scripts/composition.py"
