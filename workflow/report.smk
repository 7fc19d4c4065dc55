# Altair report: self-contained HTML (inline Vega) plus a PNG per figure.


rule report:
    input:
        RESULTS + "/atlas.duckdb",
    output:
        RESULTS + "/report/index.html",
    log:
        LOGS + "/report.log",
    localrule: True
    script:
        "../scripts/report.py"
