# DuckDB views over every shard; cheap to rebuild whenever shards are added.


rule atlas:
    input:
        shards=composition_shards,
        invariance=invariance_shards,
        metric_audit=f"{RESULTS}/metric_audit/metric_audit.parquet",
        metas=all_metas,
    output:
        f"{RESULTS}/atlas.duckdb",
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/atlas.log",
    localrule: True
    script:
        "../scripts/atlas.py"
