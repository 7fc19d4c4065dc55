# Altair report: self-contained HTML (inline Vega) plus a PNG per figure.


rule report:
    input:
        f"{RESULTS}/atlas.duckdb",
    output:
        f"{RESULTS}/report/index.html",
    conda:
        "../envs/compatlas.yaml"
    log:
        f"{LOGS}/report.log",
    localrule: True
    script:
        "../scripts/report.py"
