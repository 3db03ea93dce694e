-- decontamination: what rule decontaminate rejected, per dataset, reason, what the prompts matched (the benchmark,
-- or the dataset whose prompt they nearly duplicate: one row per pair of datasets) and the rule, with the prompts
-- checked and kept per dataset. Run by hand (duckdb CLI, repo root):
--   SET VARIABLE kept_files = 'results/*/decontaminated/*.parquet';          -- the prompts kept
--   SET VARIABLE rejected_files = 'results/*/rejected/decontaminate/*.parquet';
--   .read src/eagle3_data/sql/decontamination.sql
-- Reject details (eagle3_data.decontaminate.stage): benchmark_overlap '<benchmark> <item id> (<rule>[: N shared, e.g.
-- '<n-gram>'])';
-- near_duplicate 'near-duplicate of <dataset>/<sample_id> (estimated Jaccard J >= threshold)'.
WITH kept AS (
    SELECT dataset, count(*)::BIGINT AS kept FROM read_parquet(getvariable('kept_files')) GROUP BY ALL
), rej AS (
    SELECT dataset, reason, detail, sample_id
    FROM read_parquet(getvariable('rejected_files'), union_by_name = true)
    WHERE stage = 'decontaminate'
), per_dataset AS (
    SELECT d.dataset, coalesce(k.kept, 0) + coalesce(r.n, 0) AS checked, coalesce(k.kept, 0) AS kept
    FROM (SELECT dataset FROM kept UNION SELECT dataset FROM rej) d
    LEFT JOIN kept k USING (dataset)
    LEFT JOIN (SELECT dataset, count(*)::BIGINT AS n FROM rej GROUP BY ALL) r USING (dataset)
), matched AS (
    SELECT dataset, reason,
        CASE reason WHEN 'benchmark_overlap' THEN split_part(detail, ' ', 1)
                    ELSE regexp_extract(detail, '^near-duplicate of ([^/]+)/', 1) END AS against,
        CASE reason WHEN 'benchmark_overlap' THEN regexp_extract(detail, '\((exact|whitespace|normalized|[0-9]+-gram)', 1)
                    ELSE 'minhash' END AS rule,
        CASE reason WHEN 'benchmark_overlap' THEN regexp_extract(detail, '^[^ ]+ (.*) \([^(]*\)$', 1)
                    ELSE regexp_extract(detail, '^near-duplicate of [^/]+/(.*) \(estimated', 1) END AS item,
        nullif(regexp_extract(detail, 'e\.g\. ''([^'']*)''\)$', 1), '') AS example
    FROM rej
)
SELECT p.dataset, p.checked, p.kept, m.reason, m.against, m.rule, count(m.reason)::BIGINT AS prompts,
    left(string_agg(DISTINCT m.item, ', ' ORDER BY m.item), 200) AS items,
    min(m.example) AS example
FROM per_dataset p LEFT JOIN matched m USING (dataset)
GROUP BY ALL
ORDER BY p.dataset, m.reason NULLS FIRST, prompts DESC, m.against, m.rule
