"""Stage 4, function: what each Q/K/V edge does. Edge attribution (``edge_attribution``: EAP,
EAP-IG, exact patching; ``eap_attn``), measured on the model (``edge_measure``), and how far a
composition score agrees with it, with its uncertainty (``agreement``). Builds on
``compatlas.behaviour``."""
