# Attention-only models trained by the pipeline: one job per checkpoint, each resuming the
# previous checkpoint's state, so adding a checkpoint at the end trains only the new segment.


rule train:
    input:
        previous_train_state,
    output:
        state=TRAIN_STATE,
        loss=TRAIN_LOSS,
    params:
        spec=segment_spec,
        step=lambda wc: checkpoint_plan(wc).step,
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/train/{{model}}/{{checkpoint}}.log",
    threads: 1  # training pins one thread (compatlas.models.training.one_thread)
    resources:
        mem_mb=2000,
        runtime=60,
    script:
        "../scripts/train.py"
