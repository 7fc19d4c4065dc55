-- Where the circuit's K edge stands in each metric x space, at every checkpoint of its model: the
-- circuit edge is the K edge exact patching ranks first at the model's last checkpoint (the largest
-- |exact|; a KV group's edge is one, into the KV head); at each checkpoint, its rank by composition
-- score among the K edges into the same reader (rank 1: the largest score; a KV head's composition
-- is the largest of its query heads', as in composition_vs_function), of n_edges. On the trained
-- model it asks, cell by cell, whether composition singled out the edge that came to carry the task,
-- and from which step on.
CREATE VIEW circuit_edge_rank AS
WITH circuit AS (
    SELECT e.model, arg_max([e.writer_layer, e.writer_head, e.reader_layer, e.reader_kv_head], abs(e.exact)) AS edge,
        arg_max(e.exact, abs(e.exact)) AS exact_last
    FROM edge_attribution e JOIN checkpoints c USING (model, checkpoint)
    WHERE c.latest AND e.comp = 'K' AND e.exact IS NOT NULL AND NOT isnan(e.exact)
    GROUP BY e.model),
units AS (
    SELECT c.model, c.checkpoint, c.metric, c.space, c.writer_layer, c.writer_head, c.reader_layer,
        c.reader_head // greatest(1, m.n_heads // coalesce(m.n_kv_heads, m.n_heads)) AS reader_unit, max(c.score) AS score
    FROM composition c JOIN models m USING (model, checkpoint) SEMI JOIN circuit USING (model)
    WHERE c.comp = 'K' GROUP BY ALL),
ranked AS (
    SELECT *, rank() OVER (PARTITION BY model, checkpoint, metric, space, reader_layer, reader_unit ORDER BY score DESC) AS rank,
        count(*) OVER (PARTITION BY model, checkpoint, metric, space, reader_layer, reader_unit) AS n_edges
    FROM units)
SELECT r.model, r.checkpoint, k.checkpoint_step, r.metric, r.space, r.writer_layer, r.writer_head, r.reader_layer,
    r.reader_unit AS reader_kv_head, circuit.exact_last, r.score, r.rank, r.n_edges
FROM ranked r JOIN circuit USING (model) JOIN checkpoints k USING (model, checkpoint)
WHERE [r.writer_layer, r.writer_head, r.reader_layer, r.reader_unit] = circuit.edge;
