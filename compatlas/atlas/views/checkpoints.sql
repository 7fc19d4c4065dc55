-- Checkpoints in training order: the step (null for a model without a series) and `latest`, each
-- model's last checkpoint (highest step; a model without steps has one), so "the last checkpoint
-- of each model" is `WHERE latest` here and in every view that has a checkpoint (the atlas joins
-- this view to each: database.with_latest).
CREATE VIEW checkpoints AS SELECT model, checkpoint, checkpoint_step,
    row_number() OVER (PARTITION BY model ORDER BY checkpoint_step DESC NULLS LAST, checkpoint DESC) = 1 AS latest
    FROM models;
