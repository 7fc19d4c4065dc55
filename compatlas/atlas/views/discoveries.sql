-- The calibrated answer: causal pairs whose q-value (Benjamini-Hochberg over the distinct tests of
-- one model x checkpoint x metric x space x comp) is at most the configured false discovery rate.
-- A KV head's test (test_unit = 'kv_head') is one discovery with a row per query head of its group
-- (test_reader_heads); count findings with `WHERE reader_head = test_reader_heads[1]`.
CREATE VIEW discoveries AS SELECT * FROM composition_z WHERE q_value <= {fdr};
