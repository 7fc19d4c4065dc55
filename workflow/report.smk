# Altair report: an overview page and a page per model (self-contained HTML, inline Vega), a PNG per figure on them.


rule report:
    input:
        f"{RESULTS}/atlas.duckdb",
    output:
        f"{RESULTS}/report/index.html",
    params:
        config=report_config(),
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/report.log",
    localrule: True
    script:
        "../scripts/report.py"
