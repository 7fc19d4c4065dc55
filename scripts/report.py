"""Snakemake adapter: draw the report (overview + a page per model) from the atlas."""
from compatlas.worker import hand_off

hand_off(snakemake)  # run in the run's job server, where torch is already imported

from pathlib import Path

from compatlas.logs import log_peak_memory, setup
from compatlas.report import build_report

log = setup(snakemake.log[0])
files = build_report(snakemake.input[0], Path(snakemake.output[0]).parent, config=snakemake.params.config)
log.info("report: %d files in %s", len(files), Path(snakemake.output[0]).parent)
log_peak_memory()
