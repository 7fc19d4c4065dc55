"""Stage 3, composition: the scores of every writer/reader head pair (``scores``: head factors,
the metrics, the Gaussian and spectrum-kept nulls; a block's layer pairs, tiles of the layer
grid, come from ``compatlas.tiles``), the spaces they are taken in (``token_space``;
``activation_space`` from the model's own ``moments`` over a ``text_sample``), one composition
job at the card's limit (``job``, ``job_factors``, ``small_linalg``, ``precision``, ``table``),
and the calibration of its discoveries (``calibration``). Builds on ``compatlas.models`` and,
for the activation statistics, ``compatlas.behaviour``."""
