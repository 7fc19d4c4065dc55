"""The audits of the metrics: ``invariance`` (does a score survive a change of residual basis)
and ``metric_audit`` (Lieberum's axioms on canonical constructions). Builds on
``compatlas.composition``."""
