# DuckDB views over every shard; cheap to rebuild whenever shards are added.


rule atlas:
    input:
        shards=all_shards(SHARD),
        null_shards=all_shards(NULL_SHARD),
        calibration=calibration_shards,
        invariance=invariance_shards,
        metric_audit=f"{RESULTS}/metric_audit/metric_audit.parquet",
        metas=all_metas,
        induction_tokens=induction_shards(INDUCTION_TOKENS),
        head_scores=induction_shards(HEAD_SCORES),
        edge_attribution=edge_attribution_shards,
        training_loss=training_loss_shards,
    output:
        f"{RESULTS}/atlas.duckdb",
    params:
        thresholds={
            "prev_token_threshold": setting("induction", "prev_token_threshold"),
            "induction_threshold": setting("induction", "induction_threshold"),
            "fdr": setting("composition", "fdr"),
        },
        # Snakemake does not remake a missing shard while the atlas above it exists, so a shard
        # set aside (failed checksum) reruns the atlas, whose missing inputs are then remade
        set_aside=SET_ASIDE,
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/atlas.log",
    localrule: True
    script:
        "../scripts/atlas.py"
