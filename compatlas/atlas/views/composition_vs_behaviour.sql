-- The payoff table: does a metric (in a space, for a comp) pick out the heads that do induction?
-- Spearman = Pearson on average ranks; AUROC = Mann-Whitney U / (n_pos n_neg) from the same ranks.
-- Discovery precision / recall: of "the reader has a discovery from a previous-token head" for
-- "the reader is an induction head". n_discoveries counts tests: a KV head's finding once.
-- Spearman is NULL from fewer than {min_readers} readers (2 readers give +-1), AUROC NULL unless
-- both classes have {min_class} heads; n_readers and n_induction_heads stand beside them.
CREATE VIEW composition_vs_behaviour AS
WITH ranked AS (
    SELECT *,
      rank() OVER (PARTITION BY model, checkpoint, metric, space, comp ORDER BY best_score)
        + (count(*) OVER (PARTITION BY model, checkpoint, metric, space, comp, best_score) - 1) / 2.0 AS r_score,
      rank() OVER (PARTITION BY model, checkpoint, metric, space, comp ORDER BY induction_mean)
        + (count(*) OVER (PARTITION BY model, checkpoint, metric, space, comp, induction_mean) - 1) / 2.0 AS r_ind,
      rank() OVER (PARTITION BY model, checkpoint, metric, space, comp ORDER BY ablation_drop)
        + (count(*) OVER (PARTITION BY model, checkpoint, metric, space, comp, ablation_drop) - 1) / 2.0 AS r_abl
    FROM reader_best_composition)
SELECT model, checkpoint, metric, space, comp,
    count(*) AS n_readers, count_if(is_induction)::BIGINT AS n_induction_heads,
    CASE WHEN count(*) >= {min_readers} THEN corr(r_score, r_ind) END AS spearman_induction,
    CASE WHEN count(*) >= {min_readers} THEN corr(r_score, r_abl) END AS spearman_ablation,
    CASE WHEN count_if(is_induction) >= {min_class} AND count_if(NOT is_induction) >= {min_class} THEN
      (sum(CASE WHEN is_induction THEN r_score ELSE 0 END) - sum(is_induction::INTEGER) * (sum(is_induction::INTEGER) + 1) / 2.0)
      / NULLIF(sum(is_induction::INTEGER) * (count(*) - sum(is_induction::INTEGER)), 0) END AS auroc,
    coalesce(any_value(d.n_discoveries), 0)::BIGINT AS n_discoveries,
    count_if(prev_discovery)::BIGINT AS n_readers_with_discovery,
    count_if(prev_discovery AND is_induction) / NULLIF(count_if(prev_discovery), 0) AS discovery_precision,
    count_if(prev_discovery AND is_induction) / NULLIF(count_if(is_induction), 0) AS discovery_recall
FROM ranked LEFT JOIN (SELECT model, checkpoint, metric, space, comp, count(*) AS n_discoveries
                       FROM discoveries WHERE reader_head = test_reader_heads[1] GROUP BY ALL) d USING (model, checkpoint, metric, space, comp)
GROUP BY ALL;
