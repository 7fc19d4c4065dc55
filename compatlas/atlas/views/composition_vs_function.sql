-- Composition against function: does a weights-based score (and its z against the spectrum
-- null, and its p-value) pick out the edges that carry the induction task by edge attribution?
-- Per model x checkpoint x attribution method x metric x space x comp, over the causal edges:
-- an edge is a writer head x reader query head (Q) or x reader KV head (K, V: the KV group's one
-- input; its composition is the largest of its query heads' scores, the smallest p).
-- Function = |attribution score|. The top of the function: the smallest set of edges (of one
-- comp) holding half of that comp's total |attribution|; a handful of edges where the function is
-- concentrated, many where it is spread, with no threshold to tune.
-- Spearman = Pearson on average ranks; AUROC = Mann-Whitney U / (n_top n_rest) of the score for
-- the top set; average precision with the edges in descending score (ascending p, ties by score);
-- discovery precision / recall: of the edges with a discovery (q <= fdr in any query head) for
-- the top set. Edges with no z (a zero null spread) or no p are left out of that score's columns.
-- Within one layer pair: the mean over (writer layer, reader layer) of the Spearman of score and
-- function among that pair's edges (pairs of 3 edges or more, and both sides not constant), and
-- how many layer pairs it averages: whether a score tells apart the heads of one layer pair, once
-- the depth (scale) that separates layer pairs is taken out.
CREATE VIEW composition_vs_function AS
WITH edges AS (
    SELECT model, checkpoint, method, comp, writer_layer, writer_head, reader_layer,
        CASE WHEN comp = 'Q' THEN reader_head ELSE reader_kv_head END AS reader_unit, any_value(abs(score)) AS fn
    FROM edge_attribution GROUP BY ALL),
top AS (
    SELECT *, coalesce(sum(fn) OVER (PARTITION BY model, checkpoint, method, comp
                                     ORDER BY fn DESC, writer_layer, writer_head, reader_layer, reader_unit
                                     ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)
              < 0.5 * sum(fn) OVER (PARTITION BY model, checkpoint, method, comp) AS is_top
    FROM edges),
units AS (
    SELECT DISTINCT model, checkpoint, comp, writer_layer, writer_head, reader_layer, reader_head,
        CASE WHEN comp = 'Q' THEN reader_head ELSE reader_kv_head END AS reader_unit
    FROM edge_attribution),
comp_units AS (
    SELECT c.model, c.checkpoint, c.metric, c.space, c.comp, c.writer_layer, c.writer_head, c.reader_layer,
        u.reader_unit, max(c.score) AS score, max(c.z_spectrum) AS z, min(c.p_value) AS p,
        coalesce(bool_or(c.q_value <= {fdr}), false) AS discovered
    FROM composition_z c JOIN units u USING (model, checkpoint, comp, writer_layer, writer_head, reader_layer, reader_head)
    GROUP BY ALL),
joined AS (
    SELECT *, z IS NULL AS no_z, p IS NULL AS no_p
    FROM comp_units JOIN top USING (model, checkpoint, comp, writer_layer, writer_head, reader_layer, reader_unit)),
ranked AS (
    SELECT *,
      rank() OVER (PARTITION BY model, checkpoint, method, metric, space, comp ORDER BY score)
        + (count(*) OVER (PARTITION BY model, checkpoint, method, metric, space, comp, score) - 1) / 2.0 AS r_score,
      rank() OVER (PARTITION BY model, checkpoint, method, metric, space, comp ORDER BY fn)
        + (count(*) OVER (PARTITION BY model, checkpoint, method, metric, space, comp, fn) - 1) / 2.0 AS r_fn,
      rank() OVER (PARTITION BY model, checkpoint, method, metric, space, comp, writer_layer, reader_layer ORDER BY score)
        + (count(*) OVER (PARTITION BY model, checkpoint, method, metric, space, comp, writer_layer, reader_layer, score) - 1)
          / 2.0 AS r_score_lp,
      rank() OVER (PARTITION BY model, checkpoint, method, metric, space, comp, writer_layer, reader_layer ORDER BY fn)
        + (count(*) OVER (PARTITION BY model, checkpoint, method, metric, space, comp, writer_layer, reader_layer, fn) - 1)
          / 2.0 AS r_fn_lp,
      rank() OVER (PARTITION BY model, checkpoint, method, metric, space, comp, no_z ORDER BY z)
        + (count(*) OVER (PARTITION BY model, checkpoint, method, metric, space, comp, no_z, z) - 1) / 2.0 AS r_z,
      rank() OVER (PARTITION BY model, checkpoint, method, metric, space, comp, no_z ORDER BY fn)
        + (count(*) OVER (PARTITION BY model, checkpoint, method, metric, space, comp, no_z, fn) - 1) / 2.0 AS r_fn_z,
      rank() OVER (PARTITION BY model, checkpoint, method, metric, space, comp, no_p ORDER BY p DESC)
        + (count(*) OVER (PARTITION BY model, checkpoint, method, metric, space, comp, no_p, p) - 1) / 2.0 AS r_p,
      rank() OVER (PARTITION BY model, checkpoint, method, metric, space, comp, no_p ORDER BY fn)
        + (count(*) OVER (PARTITION BY model, checkpoint, method, metric, space, comp, no_p, fn) - 1) / 2.0 AS r_fn_p,
      count_if(is_top) OVER (PARTITION BY model, checkpoint, method, metric, space, comp
                             ORDER BY score DESC, writer_layer, writer_head, reader_layer, reader_unit ROWS UNBOUNDED PRECEDING)
        / row_number() OVER (PARTITION BY model, checkpoint, method, metric, space, comp
                             ORDER BY score DESC, writer_layer, writer_head, reader_layer, reader_unit) AS prec_score,
      count_if(is_top) OVER (PARTITION BY model, checkpoint, method, metric, space, comp, no_z
                             ORDER BY z DESC, score DESC, writer_layer, writer_head, reader_layer, reader_unit ROWS UNBOUNDED PRECEDING)
        / row_number() OVER (PARTITION BY model, checkpoint, method, metric, space, comp, no_z
                             ORDER BY z DESC, score DESC, writer_layer, writer_head, reader_layer, reader_unit) AS prec_z,
      count_if(is_top) OVER (PARTITION BY model, checkpoint, method, metric, space, comp, no_p
                             ORDER BY p, score DESC, writer_layer, writer_head, reader_layer, reader_unit ROWS UNBOUNDED PRECEDING)
        / row_number() OVER (PARTITION BY model, checkpoint, method, metric, space, comp, no_p
                             ORDER BY p, score DESC, writer_layer, writer_head, reader_layer, reader_unit) AS prec_p
    FROM joined),
within AS (
    SELECT model, checkpoint, method, metric, space, comp, avg(rho) AS spearman_within_layer_pair,
        count(rho) AS n_layer_pairs
    FROM (SELECT model, checkpoint, method, metric, space, comp, writer_layer, reader_layer,
              CASE WHEN count(*) >= 3 THEN corr(r_score_lp, r_fn_lp) END AS rho
          FROM ranked GROUP BY ALL)
    WHERE NOT isnan(rho)
    GROUP BY ALL),
overall AS (
SELECT model, checkpoint, method, metric, space, comp,
    count(*) AS n_edges, count_if(is_top)::BIGINT AS n_top, sum(fn) FILTER (WHERE is_top) / sum(fn) AS top_share,
    corr(r_score, r_fn) AS spearman,
    (sum(r_score) FILTER (WHERE is_top) - count_if(is_top) * (count_if(is_top) + 1) / 2.0)
      / NULLIF(count_if(is_top) * count_if(NOT is_top), 0) AS auroc,
    sum(prec_score) FILTER (WHERE is_top) / NULLIF(count_if(is_top), 0) AS average_precision,
    corr(r_z, r_fn_z) FILTER (WHERE NOT no_z) AS spearman_z,
    (sum(r_z) FILTER (WHERE is_top AND NOT no_z) - count_if(is_top AND NOT no_z) * (count_if(is_top AND NOT no_z) + 1) / 2.0)
      / NULLIF(count_if(is_top AND NOT no_z) * count_if(NOT is_top AND NOT no_z), 0) AS auroc_z,
    sum(prec_z) FILTER (WHERE is_top AND NOT no_z) / NULLIF(count_if(is_top AND NOT no_z), 0) AS average_precision_z,
    corr(r_p, r_fn_p) FILTER (WHERE NOT no_p) AS spearman_p,
    (sum(r_p) FILTER (WHERE is_top AND NOT no_p) - count_if(is_top AND NOT no_p) * (count_if(is_top AND NOT no_p) + 1) / 2.0)
      / NULLIF(count_if(is_top AND NOT no_p) * count_if(NOT is_top AND NOT no_p), 0) AS auroc_p,
    sum(prec_p) FILTER (WHERE is_top AND NOT no_p) / NULLIF(count_if(is_top AND NOT no_p), 0) AS average_precision_p,
    count_if(discovered)::BIGINT AS n_discoveries,
    count_if(discovered AND is_top) / NULLIF(count_if(discovered), 0) AS discovery_precision,
    count_if(discovered AND is_top) / NULLIF(count_if(is_top), 0) AS discovery_recall
FROM ranked
GROUP BY ALL)
SELECT o.*, w.spearman_within_layer_pair, coalesce(w.n_layer_pairs, 0) AS n_layer_pairs
FROM overall o LEFT JOIN within w USING (model, checkpoint, method, metric, space, comp);
