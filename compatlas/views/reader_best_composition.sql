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
           coalesce(bool_or(c.q_value <= {fdr}), false) AS prev_discovery
    FROM composition_z c JOIN prev_heads p
      ON c.model = p.model AND c.checkpoint = p.checkpoint AND c.writer_layer = p.layer AND c.writer_head = p.head
    GROUP BY ALL)
SELECT b.*, h.prev_token_mean, h.induction_mean, h.ablation_drop, h.induction_mean >= {ind} AS is_induction
FROM best b JOIN head_scores h USING (model, checkpoint, layer, head);
