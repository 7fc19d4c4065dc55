# Behaviour by forward passes: induction-strength sweeps, head attention scores, head ablation.
# After extraction: it reuses the model extraction built, and reads the extraction's metadata.


rule induction:
    input:
        meta=WEIGHTS_META,
    output:
        tokens=INDUCTION_TOKENS,
        heads=HEAD_SCORES,
    params:
        entry=model_entry,
        checkpoint=checkpoint_spec,
        settings=model_induction,
        workdir=lambda wc: f"{RESULTS}/models/{wc.model}/{wc.checkpoint}",
        device=setting("device"),
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/induction/{{model}}/{{checkpoint}}.log",
    priority: model_priority
    resources:
        mem_mb=8000,
        runtime=120,
    script:
        "../scripts/induction.py"


# Where induction.edge_attribution.jobs splits the sequences: each share's attribution (every
# method, every edge) as sums that the edge attribution job merges exactly, so that the longest
# chain of a large model runs on several cores.
rule edge_attribution_share:
    input:
        meta=WEIGHTS_META,
    output:
        EDGE_SHARE,
    params:
        entry=model_entry,
        checkpoint=checkpoint_spec,
        settings=model_share_settings,
        workdir=lambda wc: f"{RESULTS}/models/{wc.model}/{wc.checkpoint}",
        device=setting("device"),
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/edge_attribution_share/{{model}}/{{checkpoint}}/{{share}}.log",
    priority: model_priority
    resources:
        mem_mb=8000,
        runtime=120,
    script:
        "../scripts/edge_attribution_share.py"


# Where the attribution is split, exact patching is too: each job merges the shares' sums, draws
# the sample from them as one job would, and patches it on its share of the exact sequences.
rule exact_patching_share:
    input:
        meta=WEIGHTS_META,
        composition=edge_stratify_shards,
        shares=edge_share_shards,
    output:
        EXACT_SHARE,
    params:
        entry=model_entry,
        checkpoint=checkpoint_spec,
        settings=model_edge_settings,
        workdir=lambda wc: f"{RESULTS}/models/{wc.model}/{wc.checkpoint}",
        device=setting("device"),
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/exact_patching_share/{{model}}/{{checkpoint}}/{{share}}.log",
    priority: model_priority
    resources:
        mem_mb=8000,
        runtime=120,
    script:
        "../scripts/exact_patching_share.py"


# Function beside the weights: every causal writer -> reader edge per comp scored by its effect
# on the induction task (the config's methods for all, exact edge patching for a sample stratified
# over |attribution| and over one composition score), on the same boot; where the work is split
# over jobs, only their merge (no model booted).
rule edge_attribution:
    input:
        meta=WEIGHTS_META,
        composition=edge_stratify_shards,
        shares=edge_share_shards,
        exact=exact_share_shards,
    output:
        EDGE_ATTRIBUTION,
    params:
        entry=model_entry,
        checkpoint=checkpoint_spec,
        settings=model_edge_settings,
        workdir=lambda wc: f"{RESULTS}/models/{wc.model}/{wc.checkpoint}",
        device=setting("device"),
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/edge_attribution/{{model}}/{{checkpoint}}.log",
    priority: model_priority
    resources:
        mem_mb=8000,
        runtime=120,
    script:
        "../scripts/edge_attribution.py"
