# DuckDB views over every shard; cheap to rebuild whenever shards are added.


rule atlas:
    input:
        unpack(atlas_input_files),
    output:
        f"{RESULTS}/atlas.duckdb",
    params:
        thresholds={
            "prev_token_threshold": setting("induction", "prev_token_threshold"),
            "induction_threshold": setting("induction", "induction_threshold"),
            "fdr": setting("composition", "fdr"),
        },
    # Every other job of the run but the report comes before it, so it waits for no free core
    # and leaves none idle: its bootstraps run on these threads (capped at --cores) while DuckDB
    # stores composition_vs_function, one core's work.
    threads: 4
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/atlas.log",
    localrule: True
    script:
        "../scripts/atlas.py"


# Snakemake remakes a missing file only for a job that needs it, and while the atlas exists none
# does ("Nothing to be done"): a shard set aside for failing its checksum, removed with a failed
# job or deleted by hand would stay missing, and the atlas would go on lacking it. So with any of
# its inputs missing the atlas is dated to 1970 (its content unchanged, still answering queries):
# every input is then newer, the atlas is rebuilt and every missing input remade for it. The DAG's
# own settings (--forcerun) are not yet set while the workflow is parsed. One second after the
# epoch, not the epoch: Snakemake reads an output's mtime of 0 as none and skips the check of
# newer inputs (the rebuild had happened only through the `code` trigger, the script being newer
# than the atlas); and with max-checksum-file-size 0 (profiles/default) a newer input counts even
# where its content is the one recorded.
# The same for an atlas a read-write session wrote to (a WAL beside it, or its bytes changed): the
# rebuild moves the session's WAL aside (compatlas/atlas/files.py).
# A dry run (-n) only says so (stale_atlas, common.smk).


if workflow.is_main_process and os.path.exists(rules.atlas.output[0]):
    from compatlas.atlas.files import as_built, wal_path

    _atlas = rules.atlas.output[0]
    _missing = [f for f in atlas_inputs() if not os.path.exists(f)]
    if _missing:
        stale_atlas(_atlas, f"{len(_missing)} inputs of the atlas are missing (e.g. {_missing[0]})",
                    "remaking them and the atlas", "remakes them and the atlas")
    elif wal_path(_atlas).exists() or as_built(_atlas) is False:
        stale_atlas(_atlas, f"{_atlas} was written to by a read-write session", "rebuilding it", "rebuilds it")
    elif as_built(_atlas) is None:
        stale_atlas(_atlas, f"{_atlas} has no seal (.sha256 beside it), so whether it changed cannot be told",
                    "rebuilding it", "rebuilds it")
