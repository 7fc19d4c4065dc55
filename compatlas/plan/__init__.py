"""Stage 0, the plan: the config validated once (``config``), each model's source and checkpoints
checked before any job runs (``model_checks``, ``checkpoints``, ``hub_refs``), and the run it asks
for (``build``: models x checkpoints x metrics x spaces x blocks). The Snakefile reads it through
the names below. Builds on ``compatlas.models.sources`` (what a source is) and the shared bottom."""

from compatlas.plan.build import CheckpointPlan, ModelPlan, Plan, build_plan, freeze, scored_layers, thaw

__all__ = ["CheckpointPlan", "ModelPlan", "Plan", "build_plan", "freeze", "scored_layers", "thaw"]
