# Load each model (x checkpoint) once through transformer_lens and keep its attention weights.
# A checkpoint: the number of layer-pair blocks downstream depends on the model's layer count.


checkpoint extract:
    output:
        tensors=WEIGHTS + "/weights.safetensors",
        meta=WEIGHTS + "/meta.json",
    params:
        entry=model_entry,
        checkpoint=checkpoint_spec,
        workdir=lambda wc: f"{RESULTS}/models/{wc.model}/{wc.checkpoint}",
    log:
        LOGS + "/extract/{model}/{checkpoint}.log",
    threads: 2
    resources:
        mem_mb=8000,
        runtime=60,
    script:
        "../scripts/extract.py"
