-- Per model x filler setting x role: the mean A (B) power over tokens, its spread across tokens,
-- and B vs nearby-B vs random. Tokens' sequences are independent, so standard errors add in quadrature.
CREATE VIEW induction_summary AS SELECT
    model, checkpoint, filler_before, filler_between, role,
    count(*) AS n_tokens, sum(n) AS n_sequences,
    avg(mean) AS mean_strength, sqrt(sum(stderr * stderr)) / count(*) AS mean_stderr,
    stddev_samp(mean) AS power_spread, quantile_cont(mean, 0.1) AS power_p10, quantile_cont(mean, 0.9) AS power_p90,
    avg(near_b_mean) AS near_b_mean, sqrt(sum(near_b_stderr * near_b_stderr)) / count(*) AS near_b_stderr,
    avg(random_mean) AS random_mean, sqrt(sum(random_stderr * random_stderr)) / count(*) AS random_stderr
    FROM induction_tokens GROUP BY ALL;
