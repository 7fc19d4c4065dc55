# The audits: does a score survive a change of residual basis (per model), and which of
# Lieberum's axioms does each metric satisfy in each space (canonical constructions).


rule invariance:
    input:
        tensors=WEIGHTS_TENSORS,
        meta=WEIGHTS_META,
    output:
        INVARIANCE,
    params:
        settings=setting("invariance"),
        metrics=setting("metrics"),
        spaces=model_spaces,
        layers=model_layers,
        seed=setting("composition", "seed"),
        max_condition=setting("composition", "max_condition"),
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/invariance/{{model}}/{{checkpoint}}.log",
    priority: model_priority
    resources:
        mem_mb=8000,
        runtime=60,
    script:
        "../scripts/invariance.py"


rule metric_audit:
    output:
        f"{RESULTS}/metric_audit/metric_audit.parquet",
    params:
        metrics=setting("metrics"),
        spaces=setting("spaces"),
        seed=setting("composition", "seed"),
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/metric_audit.log",
    resources:
        mem_mb=2000,
        runtime=30,
    script:
        "../scripts/metric_audit.py"
