"""Stage 2, behaviour: forward passes on the model. Repeated-token sequences (``sequences``,
``tokens``), induction strength per token (``induction``), head scores (``head_scores``), ablation
(``ablation``, ``block_skip``), and when the circuit forms over training (``formation``). Builds
on ``compatlas.models``."""
