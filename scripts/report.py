"""Snakemake adapter: draw the report (overview + a page per model) from the atlas."""
from pathlib import Path

from compatlas.logs import setup
from compatlas.report import build_report

log = setup(snakemake.log[0])
files = build_report(snakemake.input[0], Path(snakemake.output[0]).parent, config=snakemake.params.config)
log.info("report: %d files in %s", len(files), Path(snakemake.output[0]).parent)
