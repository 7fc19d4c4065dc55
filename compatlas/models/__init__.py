"""Stage 1, the models: where a model's weights come from (a hub repository, a local folder, a
GGUF file, a config built here, a run trained here), loading them into TransformerLens without
holding a checkpoint twice, and extracting the attention weights the scores read, once per
checkpoint (``weights``). Builds on the shared bottom only (``compatlas.vocab``, ``tables``,
``storage``, ``runtime``, ``progress``)."""
