-- How well the attribution (a first-order estimate) holds, on the edges exact patching measured.
-- Per comp the patched edges are a random draw stratified over |score| and over a composition
-- score (exact_sample = 'random'; so that the two can disagree; edges as in composition_vs_function)
-- and, beside it, the top edges of each method's |score| and of that composition score
-- (exact_sample = 'top': the edges that carry the function, which a draw alone rarely reaches).
-- On the random draw (n_random edges; an older shard's patched edges all count as drawn): Pearson and
-- Spearman of score with exact, the Spearman's 95% interval (spearman_lo, spearman_hi: Fisher's z
-- with the Fieller-Hartley-Pearson variance 1.06 / (n - 3), from 5 edges). On every patched edge
-- (n_exact, n_top of them added): the share of the top_k edges by |exact| that are also among the
-- top_k by |score| (top_k = 5, or all patched edges if fewer), and whether the edge of largest
-- |exact| is the one of largest |score|.
CREATE VIEW eap_vs_exact AS
WITH sampled AS (
    SELECT model, checkpoint, method, comp, writer_layer, writer_head, reader_layer,
        CASE WHEN comp = 'Q' THEN reader_head ELSE reader_kv_head END AS reader_unit,
        any_value(score) AS score, any_value(exact) AS exact, coalesce(any_value(exact_sample), 'random') AS kind
    FROM edge_attribution WHERE exact IS NOT NULL GROUP BY ALL),
drawn AS (
    SELECT *,
      rank() OVER (w ORDER BY score) + (count(*) OVER (PARTITION BY model, checkpoint, method, comp, score) - 1) / 2.0 AS r_score,
      rank() OVER (w ORDER BY exact) + (count(*) OVER (PARTITION BY model, checkpoint, method, comp, exact) - 1) / 2.0 AS r_exact
    FROM sampled WHERE kind = 'random'
    WINDOW w AS (PARTITION BY model, checkpoint, method, comp)),
on_draw AS (
    SELECT model, checkpoint, method, comp, count(*) AS n_random, corr(score, exact) AS pearson,
        corr(r_score, r_exact) AS spearman,
        CASE WHEN count(*) > 4 THEN tanh(atanh(greatest(least(corr(r_score, r_exact), 0.999999), -0.999999))
                                         - 1.96 * sqrt(1.06 / (count(*) - 3))) END AS spearman_lo,
        CASE WHEN count(*) > 4 THEN tanh(atanh(greatest(least(corr(r_score, r_exact), 0.999999), -0.999999))
                                         + 1.96 * sqrt(1.06 / (count(*) - 3))) END AS spearman_hi
    FROM drawn GROUP BY ALL),
ranked AS (
    SELECT *, least(5, count(*) OVER w) AS top_k,
      row_number() OVER (w ORDER BY abs(score) DESC, writer_layer, writer_head, reader_layer, reader_unit) AS k_score,
      row_number() OVER (w ORDER BY abs(exact) DESC, writer_layer, writer_head, reader_layer, reader_unit) AS k_exact
    FROM sampled
    WINDOW w AS (PARTITION BY model, checkpoint, method, comp)),
on_all AS (
    SELECT model, checkpoint, method, comp, count(*) AS n_exact, count_if(kind = 'top') AS n_top,
        any_value(top_k) AS top_k,
        count_if(k_score <= top_k AND k_exact <= top_k) / any_value(top_k) AS top_k_overlap,
        bool_or(k_score = 1 AND k_exact = 1) AS top_edge_agrees,
        arg_max(writer_layer || '.' || writer_head || ' -> ' || reader_layer || '.' || reader_unit, abs(exact)) AS top_exact_edge,
        arg_max(writer_layer || '.' || writer_head || ' -> ' || reader_layer || '.' || reader_unit, abs(score)) AS top_score_edge
    FROM ranked GROUP BY ALL)
SELECT a.model, a.checkpoint, a.method, a.comp, a.n_exact, coalesce(d.n_random, 0) AS n_random, a.n_top,
    d.pearson, d.spearman, d.spearman_lo, d.spearman_hi,
    a.top_k, a.top_k_overlap, a.top_edge_agrees, a.top_exact_edge, a.top_score_edge
FROM on_all a LEFT JOIN on_draw d USING (model, checkpoint, method, comp);
