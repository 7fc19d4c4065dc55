# Load each model (x checkpoint) once through transformer_lens and keep its attention weights.


rule extract:
    input:
        extract_inputs,
    output:
        tensors=WEIGHTS_TENSORS,
        meta=WEIGHTS_META,
    params:
        entry=model_entry,
        checkpoint=checkpoint_spec,
        workdir=lambda wc: f"{RESULTS}/models/{wc.model}/{wc.checkpoint}",
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/extract/{{model}}/{{checkpoint}}.log",
    priority: model_priority
    resources:
        mem_mb=8000,
        runtime=60,
    script:
        "../scripts/extract.py"
