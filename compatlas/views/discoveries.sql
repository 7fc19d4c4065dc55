-- The calibrated answer: causal pairs whose q-value (Benjamini-Hochberg over the pairs of one
-- model x checkpoint x metric x space x comp) is at most the configured false discovery rate.
CREATE VIEW discoveries AS SELECT * FROM composition_z WHERE q_value <= {fdr};
