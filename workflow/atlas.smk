# DuckDB views over every shard; cheap to rebuild whenever shards are added.


rule atlas:
    input:
        shards=composition_shards,
        metas=all_metas,
    output:
        RESULTS + "/atlas.duckdb",
    log:
        LOGS + "/atlas.log",
    localrule: True
    script:
        "../scripts/atlas.py"
