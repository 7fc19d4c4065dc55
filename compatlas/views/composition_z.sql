-- Every causal pair's score with its z-scores against both nulls, its p- and q-value
-- (calibration) and its checkpoint's step and `latest` flag (checkpoints).
CREATE VIEW composition_z AS SELECT c.*,
    c.score - c.baseline_gaussian_mean AS score_minus_gaussian,
    (c.score - c.baseline_spectrum_mean) / NULLIF(c.baseline_spectrum_std, 0) AS z_spectrum,
    (c.score - c.baseline_gaussian_mean) / NULLIF(c.baseline_gaussian_std, 0) AS z_gaussian,
    p.n_null, p.p_value, p.q_value, k.checkpoint_step, k.latest
    FROM composition c LEFT JOIN calibration p
    USING (model, checkpoint, processing, metric, space, comp, writer_layer, writer_head, reader_layer, reader_head)
    LEFT JOIN checkpoints k USING (model, checkpoint);
