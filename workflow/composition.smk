# Composition scores for one (model, checkpoint, metric, space, block of layer pairs).


rule composition:
    input:
        tensors=WEIGHTS + "/weights.safetensors",
        meta=WEIGHTS + "/meta.json",
    output:
        SHARD,
    params:
        layers=lambda wc: config["models"][wc.model].get("layers"),
        settings=config["composition"],
        device=config["device"],
        dtype=config["dtype"],
    log:
        LOGS + "/composition/{model}/{checkpoint}/{metric}-{space}-{block}.log",
    threads: 2
    resources:
        mem_mb=4000,
        runtime=30,
    script:
        "../scripts/composition.py"
