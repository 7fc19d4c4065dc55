-- For every reader head: its strongest composition (per metric, space, comp) with an earlier
-- previous-token head (threshold, or the model's best one outside the last layer if none passes),
-- beside its induction score and ablation effect.
CREATE VIEW reader_best_composition AS
WITH ranked_prev AS (  -- heads of the last layer have no readers
    SELECT model, checkpoint, layer, head, prev_token_mean,
           row_number() OVER (PARTITION BY model, checkpoint ORDER BY prev_token_mean DESC, layer, head) AS r
    FROM head_scores h
    WHERE layer < (SELECT max(layer) FROM head_scores l WHERE l.model = h.model AND l.checkpoint = h.checkpoint)),
prev_heads AS (SELECT model, checkpoint, layer, head FROM ranked_prev WHERE prev_token_mean >= {prev} OR r = 1),
best AS (
    SELECT c.model, c.checkpoint, c.metric, c.space, c.comp, c.reader_layer AS layer, c.reader_head AS head,
           max(c.score) AS best_score,
           max((c.score - c.baseline_spectrum_mean) / NULLIF(c.baseline_spectrum_std, 0)) AS best_z_spectrum,
           arg_max(c.writer_layer || '.' || c.writer_head, c.score) AS best_writer,
           coalesce(bool_or(v.q_value <= {fdr}), false) AS prev_discovery
    -- scores and p-values each cut to the previous-token writers before they are joined (joining
    -- them first, as composition_z does, hashes every pair: a 70B model's 349M)
    FROM (SELECT * FROM composition x SEMI JOIN prev_heads p ON x.model = p.model AND x.checkpoint = p.checkpoint
          AND x.writer_layer = p.layer AND x.writer_head = p.head) c
    LEFT JOIN (SELECT * FROM calibration x SEMI JOIN prev_heads p ON x.model = p.model AND x.checkpoint = p.checkpoint
          AND x.writer_layer = p.layer AND x.writer_head = p.head) v
      USING (model, checkpoint, processing, metric, space, comp, writer_layer, writer_head, reader_layer, reader_head)
    GROUP BY ALL)
SELECT b.*, h.prev_token_mean, h.induction_mean, h.ablation_drop, h.induction_mean >= {ind} AS is_induction
FROM best b JOIN head_scores h USING (model, checkpoint, layer, head);
