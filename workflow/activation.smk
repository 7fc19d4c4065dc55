# The model's own activation statistics: second moments of every head's query, key, value and
# attention output over a text sample, one forward pass per model x checkpoint (the same boot as
# induction). The activation space's composition jobs read them (compatlas/composition/activation_space.py);
# where the run's metrics include pattern_output, its scores too (compatlas/composition/pattern_output.py).


rule moments:
    input:
        meta=WEIGHTS_META,
    output:
        moments=MOMENTS,
        meta=MOMENTS_META,
    params:
        entry=model_entry,
        checkpoint=checkpoint_spec,
        settings=model_activation,
        forward=model_forward_settings,
        workdir=lambda wc: f"{RESULTS}/models/{wc.model}/{wc.checkpoint}",
        # the run scores pattern_output: the same windows give its scores, saved beside the moments
        pattern_output="pattern_output" in PLAN.metrics,
        device=setting("device"),
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/moments/{{model}}/{{checkpoint}}.log",
    priority: model_priority
    resources:
        mem_mb=8000,
        runtime=60,
    script:
        "../scripts/moments.py"
