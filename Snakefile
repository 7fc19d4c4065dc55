# compatlas: attention-head composition across pretrained transformers.
# The grid is model x checkpoint x metric x space x layer-pair block; see README.md.
from snakemake.utils import min_version

min_version("9.0")


# The built-in offline zoo, unless a config is given (--configfile replaces it, never merges).
if not config:

    configfile: "config/config.yaml"



include: "workflow/common.smk"
include: "workflow/train.smk"
include: "workflow/extract.smk"
include: "workflow/composition.smk"
include: "workflow/audit.smk"
include: "workflow/induction.smk"
include: "workflow/activation.smk"
include: "workflow/atlas.smk"
include: "workflow/report.smk"


rule all:
    default_target: True
    input:
        f"{RESULTS}/atlas.duckdb",
        f"{RESULTS}/report/index.html",
