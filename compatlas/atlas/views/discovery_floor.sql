-- How far each cell's discoveries rest on the null's resolution. With N null pairs the counting p
-- cannot go below the floor 1/(N+1); a test beyond every null pair gets the floor, or the tail
-- model's smaller p (docs/statistics.md). With k tests at or below the floor among m, BH gives the
-- floor's tests q = floor x m / k: when that is just under the false discovery rate, the count of
-- discoveries is set by the floor, not by the scores (20 tests at the floor of N = 35,235 with
-- m = 35,235 give q = 0.0499986; 19 would give 0.0526 and no discovery at the floor).
-- Per model x checkpoint x metric x space x comp with discoveries: m, n_null, the floor,
-- n_discoveries, of them n_at_floor (p at the floor) and n_below_floor (the tail model's p),
-- q_at_floor (BH's q of a test at the floor), q_one_fewer (the same with one test fewer at or below
-- the floor: floor x m / (k - 1)) and set_by_floor (tests at the floor are discoveries, and would
-- not be with one fewer). One row a test: a KV head's test counts once (test_unit = 'kv_head').
CREATE VIEW discovery_floor AS
WITH tests AS (
    SELECT model, checkpoint, metric, space, comp, any_value(n_null) AS n_null, any_value(p_value) AS p_value,
        any_value(q_value) AS q_value
    FROM calibration
    GROUP BY model, checkpoint, metric, space, comp, writer_layer, writer_head, reader_layer,
        CASE WHEN test_unit = 'kv_head' THEN -1 - reader_kv_head ELSE reader_head END),
placed AS (
    SELECT *, 1.0 / (n_null + 1) AS floor,
        p_value <= (1 + 1e-9) / (n_null + 1) AND p_value >= (1 - 1e-9) / (n_null + 1) AS at_floor,
        p_value < (1 - 1e-9) / (n_null + 1) AS below_floor
    FROM tests),
cells AS (
    SELECT model, checkpoint, metric, space, comp, count(*) AS m, max(n_null)::BIGINT AS n_null, max(floor) AS floor,
        count_if(q_value <= {fdr})::BIGINT AS n_discoveries,
        count_if(q_value <= {fdr} AND at_floor)::BIGINT AS n_at_floor,
        count_if(q_value <= {fdr} AND below_floor)::BIGINT AS n_below_floor,
        count_if(at_floor OR below_floor)::BIGINT AS k_beyond,
        max(q_value) FILTER (WHERE at_floor) AS q_at_floor
    FROM placed GROUP BY ALL)
SELECT model, checkpoint, metric, space, comp, m, n_null, floor, n_discoveries, n_at_floor, n_below_floor, q_at_floor,
    CASE WHEN k_beyond > 1 THEN floor * m / (k_beyond - 1) END AS q_one_fewer,
    n_at_floor > 0 AND coalesce(floor * m / (k_beyond - 1), 1) > {fdr} AS set_by_floor
FROM cells WHERE n_discoveries > 0;
