-- Composition against function: does a composition score (and its z against the spectrum null,
-- and its p-value) pick out the edges that carry the induction task by edge attribution?
-- Materialised when the atlas is built (a table of this SELECT: every figure aggregates every edge).
-- Per model x checkpoint x attribution method x metric x space x comp, over the causal edges:
-- an edge is a writer head x reader query head (Q) or x reader KV head (K, V: the KV group's one
-- input; its composition is the largest of its query heads' scores, the smallest p).
--
-- Against |attribution| (the columns the atlas has had since edge attribution; they reward
-- predicting noise scale: with few sequences an edge's |mean| is mostly its sampling spread, which
-- grows with the size of its activations, as every magnitude does):
-- Spearman = Pearson on average ranks; AUROC = Mann-Whitney U / (n_top n_rest) of the score for
-- the top of the function (the smallest set of edges of one comp holding half of its total
-- |attribution|); average precision with the edges in descending score (ascending p, ties by
-- score); discovery precision / recall: of the edges with a discovery (q <= fdr in any query head)
-- for the top set. Edges with no z (a zero null spread) or no p are left out of that score's columns.
-- Within one layer pair: the mean over (writer layer, reader layer) of the Spearman among that
-- pair's edges (pairs of 3 edges or more, and both sides not constant), and how many it averages.
--
-- Noise-aware (docs/edge_attribution.md#noise-aware-agreement):
-- spearman_unbiased: with half_a x half_b, the product of the means over the even and over the odd
--   sequences: unbiased for the squared function (the halves are independent), with no term that
--   grows with the noise; spearman_unbiased_within_layer_pair likewise within layer pairs.
-- spearman_t: with |t| = |mean| / standard error (whether the edge carries the task consistently).
-- auroc_significant, average_precision_significant: for the n_significant edges whose attribution
--   differs from 0 (t-test, Benjamini-Hochberg q <= fdr over the comp's edges: q_value of the shard).
-- noise_ceiling: the split-half Spearman of |half_a| with |half_b| (uncorrected): how far the
--   measurement agrees with itself; noise_ceiling_within_layer_pair likewise.
-- Reference rows (space 'oracle'), scored on the same edges, that a score must beat to claim function:
--   metric 'oracle_scale': the edge's own standard error (its noise scale; knows nothing of its mean);
--   metric 'oracle_depth': the mean |attribution| of the edge's layer pair (depth alone).
-- And one that needs neither function nor composition (space 'prior'):
--   metric 'prior_distance': writer_layer - reader_layer (nearer layers first), from the plan alone.
-- What a score adds beyond both oracles (docs/edge_attribution.md#what-composition-adds):
-- partial_unbiased: the Spearman with the unbiased function estimate after both oracles' ranks are
--   regressed out of the score's ranks and of the function's (least squares, an intercept and the
--   two ranks; the correlation of the residuals: the partial correlation of the ranks);
-- added_r2: the share of the function's rank variance the score adds to the two oracles'
--   (partial_unbiased^2 x (1 - R^2 of the oracles)). function_agreement has their bootstrap intervals.
CREATE VIEW composition_vs_function AS
WITH edges AS (
    SELECT model, checkpoint, method, comp, writer_layer, writer_head, reader_layer,
        CASE WHEN comp = 'Q' THEN reader_head ELSE reader_kv_head END AS reader_unit,
        any_value(abs(score)) AS fn, any_value(score_half_a * score_half_b) AS fn_unbiased,
        any_value(CASE WHEN score_stderr > 0 THEN abs(score) / score_stderr
                       WHEN score <> 0 THEN 'inf'::DOUBLE ELSE 0 END) AS t_abs,
        any_value(coalesce(q_value <= {fdr}, false)) AS significant,
        any_value(score_stderr) AS stderr, any_value(abs(score_half_a)) AS half_a, any_value(abs(score_half_b)) AS half_b
    FROM edge_attribution GROUP BY ALL),
top AS (
    SELECT *, coalesce(sum(fn) OVER (PARTITION BY model, checkpoint, method, comp
                                     ORDER BY fn DESC, writer_layer, writer_head, reader_layer, reader_unit
                                     ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)
              < 0.5 * sum(fn) OVER (PARTITION BY model, checkpoint, method, comp) AS is_top,
        stderr AS o_scale, avg(fn) OVER (PARTITION BY model, checkpoint, method, comp, writer_layer, reader_layer) AS o_depth
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
oracles AS (
    SELECT model, checkpoint, 'oracle_scale' AS metric, 'oracle' AS space, comp, writer_layer, writer_head, reader_layer,
        reader_unit, method, stderr AS score
    FROM top
    UNION ALL
    SELECT model, checkpoint, 'oracle_depth', 'oracle', comp, writer_layer, writer_head, reader_layer, reader_unit, method,
        o_depth
    FROM top
    UNION ALL
    SELECT model, checkpoint, 'prior_distance', 'prior', comp, writer_layer, writer_head, reader_layer, reader_unit, method,
        (writer_layer - reader_layer)::DOUBLE
    FROM top),
joined AS (
    SELECT c.*, t.method, t.fn, t.fn_unbiased, t.t_abs, t.significant, t.is_top, c.z IS NULL AS no_z, c.p IS NULL AS no_p,
        t.o_scale, t.o_depth
    FROM comp_units c JOIN top t USING (model, checkpoint, comp, writer_layer, writer_head, reader_layer, reader_unit)
    UNION ALL
    SELECT o.model, o.checkpoint, o.metric, o.space, o.comp, o.writer_layer, o.writer_head, o.reader_layer, o.reader_unit,
        o.score, NULL, NULL, false, o.method, t.fn, t.fn_unbiased, t.t_abs, t.significant, t.is_top, true, true,
        t.o_scale, t.o_depth
    FROM oracles o JOIN top t USING (model, checkpoint, method, comp, writer_layer, writer_head, reader_layer, reader_unit)),
-- Every cell (model x checkpoint x method x metric x space x comp) numbered: the windows below partition on that
-- integer, and each family of them sorts only the columns it needs (a window sorts its whole input row: one stack of
-- windows over every column, partitioned on six strings, took 20 s of the default run's atlas).
cells AS (
    SELECT model, checkpoint, method, metric, space, comp,
        row_number() OVER (ORDER BY model, checkpoint, method, metric, space, comp) AS cell
    FROM (SELECT DISTINCT model, checkpoint, method, metric, space, comp FROM joined)),
numbered AS (
    SELECT cell, writer_layer, writer_head, reader_layer, reader_unit, score, z, p, discovered, fn, fn_unbiased, t_abs,
        significant, is_top, no_z, no_p, o_scale, o_depth
    FROM joined JOIN cells USING (model, checkpoint, method, metric, space, comp)),
-- Mid-ranks from one sort each: (rank() + count(*)) / 2, where count(*) (ordered, default frame) counts the rows up to
-- the row's last tie: the same figure as rank() + (ties - 1) / 2.
ranked AS (
    SELECT cell, fn, significant, is_top, discovered,
      (rank() OVER (c ORDER BY score) + count(*) OVER (c ORDER BY score)) / 2.0 AS r_score,
      (rank() OVER (c ORDER BY fn) + count(*) OVER (c ORDER BY fn)) / 2.0 AS r_fn,
      (rank() OVER (c ORDER BY fn_unbiased) + count(*) OVER (c ORDER BY fn_unbiased)) / 2.0 AS r_fnu,
      (rank() OVER (c ORDER BY t_abs) + count(*) OVER (c ORDER BY t_abs)) / 2.0 AS r_t,
      (rank() OVER (c ORDER BY o_scale) + count(*) OVER (c ORDER BY o_scale)) / 2.0 AS r_os,
      (rank() OVER (c ORDER BY o_depth) + count(*) OVER (c ORDER BY o_depth)) / 2.0 AS r_od
    FROM numbered WINDOW c AS (PARTITION BY cell)),
ranked_in_pair AS (
    SELECT cell, writer_layer, reader_layer,
      (rank() OVER (lp ORDER BY score) + count(*) OVER (lp ORDER BY score)) / 2.0 AS r_score_lp,
      (rank() OVER (lp ORDER BY fn) + count(*) OVER (lp ORDER BY fn)) / 2.0 AS r_fn_lp,
      (rank() OVER (lp ORDER BY fn_unbiased) + count(*) OVER (lp ORDER BY fn_unbiased)) / 2.0 AS r_fnu_lp
    FROM numbered WINDOW lp AS (PARTITION BY cell, writer_layer, reader_layer)),
-- precision at each edge, the edges in descending score, ties in edge order
precision AS (
    SELECT cell, significant, is_top,
      count_if(is_top) OVER (c ROWS UNBOUNDED PRECEDING) / row_number() OVER c AS prec_score,
      count_if(significant) OVER (c ROWS UNBOUNDED PRECEDING) / row_number() OVER c AS prec_significant
    FROM numbered WINDOW c AS (PARTITION BY cell ORDER BY score DESC, writer_layer, writer_head, reader_layer, reader_unit)),
-- the z and p columns rank only the edges with a z (a p)
ranked_z AS (
    SELECT cell, is_top,
      (rank() OVER (c ORDER BY z) + count(*) OVER (c ORDER BY z)) / 2.0 AS r_z,
      (rank() OVER (c ORDER BY fn) + count(*) OVER (c ORDER BY fn)) / 2.0 AS r_fn_z,
      count_if(is_top) OVER (c ORDER BY z DESC, score DESC, writer_layer, writer_head, reader_layer, reader_unit
                             ROWS UNBOUNDED PRECEDING)
        / row_number() OVER (c ORDER BY z DESC, score DESC, writer_layer, writer_head, reader_layer, reader_unit) AS prec_z
    FROM numbered WHERE NOT no_z WINDOW c AS (PARTITION BY cell)),
ranked_p AS (
    SELECT cell, is_top,
      (rank() OVER (c ORDER BY p DESC) + count(*) OVER (c ORDER BY p DESC)) / 2.0 AS r_p,
      (rank() OVER (c ORDER BY fn) + count(*) OVER (c ORDER BY fn)) / 2.0 AS r_fn_p,
      count_if(is_top) OVER (c ORDER BY p, score DESC, writer_layer, writer_head, reader_layer, reader_unit
                             ROWS UNBOUNDED PRECEDING)
        / row_number() OVER (c ORDER BY p, score DESC, writer_layer, writer_head, reader_layer, reader_unit) AS prec_p
    FROM numbered WHERE NOT no_p WINDOW c AS (PARTITION BY cell)),
within AS (
    SELECT cell,
        avg(rho) FILTER (WHERE NOT isnan(rho)) AS spearman_within_layer_pair,
        count(rho) FILTER (WHERE NOT isnan(rho)) AS n_layer_pairs,
        avg(rho_u) FILTER (WHERE NOT isnan(rho_u)) AS spearman_unbiased_within_layer_pair
    FROM (SELECT cell, writer_layer, reader_layer,
              CASE WHEN count(*) >= 3 THEN corr(r_score_lp, r_fn_lp) END AS rho,
              CASE WHEN count(*) >= 3 THEN corr(r_score_lp, r_fnu_lp) END AS rho_u
          FROM ranked_in_pair GROUP BY ALL)
    GROUP BY ALL),
-- the measurement's agreement with itself: one figure per model x checkpoint x method x comp
halves AS (
    SELECT *,
      rank() OVER (c ORDER BY half_a) + (count(*) OVER (PARTITION BY model, checkpoint, method, comp, half_a) - 1) / 2.0 AS r_a,
      rank() OVER (c ORDER BY half_b) + (count(*) OVER (PARTITION BY model, checkpoint, method, comp, half_b) - 1) / 2.0 AS r_b,
      rank() OVER (lp ORDER BY half_a)
        + (count(*) OVER (PARTITION BY model, checkpoint, method, comp, writer_layer, reader_layer, half_a) - 1) / 2.0 AS r_a_lp,
      rank() OVER (lp ORDER BY half_b)
        + (count(*) OVER (PARTITION BY model, checkpoint, method, comp, writer_layer, reader_layer, half_b) - 1) / 2.0 AS r_b_lp
    FROM edges
    WINDOW c AS (PARTITION BY model, checkpoint, method, comp),
           lp AS (PARTITION BY model, checkpoint, method, comp, writer_layer, reader_layer)),
ceiling AS (
    SELECT model, checkpoint, method, comp, any_value(noise_ceiling) AS noise_ceiling,
        avg(rho) FILTER (WHERE NOT isnan(rho)) AS noise_ceiling_within_layer_pair
    FROM (SELECT model, checkpoint, method, comp, writer_layer, reader_layer,
              corr(r_a, r_b) OVER (PARTITION BY model, checkpoint, method, comp) AS noise_ceiling,
              CASE WHEN count(*) OVER (PARTITION BY model, checkpoint, method, comp, writer_layer, reader_layer) >= 3
                   THEN corr(r_a_lp, r_b_lp) OVER (PARTITION BY model, checkpoint, method, comp, writer_layer, reader_layer)
              END AS rho
          FROM halves)  -- a row per edge: every layer pair of a comp has as many edges, so this is the mean over pairs
    GROUP BY ALL),
by_rank AS (
    SELECT cell, count(*) AS n_edges, count_if(is_top)::BIGINT AS n_top, sum(fn) FILTER (WHERE is_top) / sum(fn) AS top_share,
        corr(r_score, r_fn) AS spearman,
        (sum(r_score) FILTER (WHERE is_top) - count_if(is_top) * (count_if(is_top) + 1) / 2.0)
          / NULLIF(count_if(is_top) * count_if(NOT is_top), 0) AS auroc,
        corr(r_score, r_fnu) AS spearman_unbiased,
        corr(r_score, r_t) AS spearman_t,
        count_if(significant)::BIGINT AS n_significant,
        (sum(r_score) FILTER (WHERE significant) - count_if(significant) * (count_if(significant) + 1) / 2.0)
          / NULLIF(count_if(significant) * count_if(NOT significant), 0) AS auroc_significant,
        count_if(discovered)::BIGINT AS n_discoveries,
        count_if(discovered AND is_top) / NULLIF(count_if(discovered), 0) AS discovery_precision,
        count_if(discovered AND is_top) / NULLIF(count_if(is_top), 0) AS discovery_recall,
        -- the pairwise correlations of ranks the partial Spearman is taken from (score s, function f, oracles a and b)
        corr(r_score, r_os) AS c_sa, corr(r_score, r_od) AS c_sb, corr(r_fnu, r_os) AS c_fa, corr(r_fnu, r_od) AS c_fb,
        corr(r_os, r_od) AS c_ab
    FROM ranked GROUP BY cell),
by_precision AS (
    SELECT cell, sum(prec_score) FILTER (WHERE is_top) / NULLIF(count_if(is_top), 0) AS average_precision,
        sum(prec_significant) FILTER (WHERE significant) / NULLIF(count_if(significant), 0) AS average_precision_significant
    FROM precision GROUP BY cell),
by_z AS (
    SELECT cell, corr(r_z, r_fn_z) AS spearman_z,
        (sum(r_z) FILTER (WHERE is_top) - count_if(is_top) * (count_if(is_top) + 1) / 2.0)
          / NULLIF(count_if(is_top) * count_if(NOT is_top), 0) AS auroc_z,
        sum(prec_z) FILTER (WHERE is_top) / NULLIF(count_if(is_top), 0) AS average_precision_z
    FROM ranked_z GROUP BY cell),
by_p AS (
    SELECT cell, corr(r_p, r_fn_p) AS spearman_p,
        (sum(r_p) FILTER (WHERE is_top) - count_if(is_top) * (count_if(is_top) + 1) / 2.0)
          / NULLIF(count_if(is_top) * count_if(NOT is_top), 0) AS auroc_p,
        sum(prec_p) FILTER (WHERE is_top) / NULLIF(count_if(is_top), 0) AS average_precision_p
    FROM ranked_p GROUP BY cell),
overall AS (
    SELECT cell, k.model, k.checkpoint, k.method, k.metric, k.space, k.comp, r.n_edges, r.n_top, r.top_share, r.spearman,
        r.auroc, e.average_precision, r.spearman_unbiased, r.spearman_t, r.n_significant, r.auroc_significant,
        e.average_precision_significant, z.spearman_z, z.auroc_z, z.average_precision_z, p.spearman_p, p.auroc_p,
        p.average_precision_p, r.n_discoveries, r.discovery_precision, r.discovery_recall, r.c_sa, r.c_sb, r.c_fa, r.c_fb,
        r.c_ab
    FROM cells k JOIN by_rank r USING (cell) JOIN by_precision e USING (cell) LEFT JOIN by_z z USING (cell)
        LEFT JOIN by_p p USING (cell)),
-- the partial correlation beyond a, then beyond b as well (the recursion of partial correlations)
first_order AS (
    SELECT *,
        (spearman_unbiased - c_sa * c_fa) / NULLIF(sqrt((1 - c_sa * c_sa) * (1 - c_fa * c_fa)), 0) AS p_sf_a,
        (c_sb - c_sa * c_ab) / NULLIF(sqrt((1 - c_sa * c_sa) * (1 - c_ab * c_ab)), 0) AS p_sb_a,
        (c_fb - c_fa * c_ab) / NULLIF(sqrt((1 - c_fa * c_fa) * (1 - c_ab * c_ab)), 0) AS p_fb_a,
        (c_fa * c_fa + c_fb * c_fb - 2 * c_fa * c_fb * c_ab) / NULLIF(1 - c_ab * c_ab, 0) AS oracles_r2
    FROM overall),
partial AS (
    SELECT * EXCLUDE (c_sa, c_sb, c_fa, c_fb, c_ab, p_sf_a, p_sb_a, p_fb_a, oracles_r2, pu),
        -- a reference row the oracles span (an oracle itself) has no partial: NULL, not rounding noise
        CASE WHEN space <> 'oracle' THEN pu END AS partial_unbiased,
        CASE WHEN space <> 'oracle' THEN pu * pu * (1 - oracles_r2) END AS added_r2
    FROM (SELECT *, (p_sf_a - p_sb_a * p_fb_a) / NULLIF(sqrt((1 - p_sb_a * p_sb_a) * (1 - p_fb_a * p_fb_a)), 0) AS pu
          FROM first_order))
SELECT o.* EXCLUDE (cell), w.spearman_within_layer_pair, coalesce(w.n_layer_pairs, 0) AS n_layer_pairs,
    w.spearman_unbiased_within_layer_pair, h.noise_ceiling, h.noise_ceiling_within_layer_pair
FROM partial o LEFT JOIN within w USING (cell)
    LEFT JOIN ceiling h USING (model, checkpoint, method, comp);
