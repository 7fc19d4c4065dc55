-- Every causal pair's score with its z-scores against both nulls, its p- and q-value
-- (calibration) and its checkpoint's step (checkpoints; `latest` comes with composition). A row per reader query
-- head; `test_unit` says what its p and q test: 'query_head' (this pair) or 'kv_head' (the writer
-- with the reader's KV head `reader_kv_head`: one test, shared by the query heads
-- `test_reader_heads`, whose rows carry the same p and q). One row per test:
-- `WHERE reader_head = test_reader_heads[1]`.
CREATE VIEW composition_z AS SELECT c.*,
    c.score - c.baseline_gaussian_mean AS score_minus_gaussian,
    (c.score - c.baseline_spectrum_mean) / NULLIF(c.baseline_spectrum_std, 0) AS z_spectrum,
    (c.score - c.baseline_gaussian_mean) / NULLIF(c.baseline_gaussian_std, 0) AS z_gaussian,
    p.test_unit, p.reader_kv_head,
    CASE WHEN p.test_unit = 'kv_head' THEN
        range(p.reader_kv_head * (m.n_heads // m.n_kv_heads), (p.reader_kv_head + 1) * (m.n_heads // m.n_kv_heads))
        ELSE [c.reader_head::BIGINT] END AS test_reader_heads,
    p.n_null, p.p_value, p.q_value, k.checkpoint_step
    FROM composition c LEFT JOIN calibration p
    USING (model, checkpoint, processing, metric, space, comp, writer_layer, writer_head, reader_layer, reader_head)
    LEFT JOIN checkpoints k USING (model, checkpoint)
    LEFT JOIN models m USING (model, checkpoint);
