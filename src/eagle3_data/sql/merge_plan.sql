-- merge_plan: one row per validated sample with the merge decision and, when kept, its merged shard.
--
-- Run by hand (duckdb CLI, from the repo root):
--   SET VARIABLE validated_files = ['results/ds_a/validated/000.parquet', 'results/ds_b/validated/000.parquet'];
--   SET VARIABLE datasets = NULL::VARCHAR[];                 -- NULL = every dataset, else a list of names
--   SET VARIABLE max_samples = MAP(['ds_a'], [100]::BIGINT[]); -- per-dataset caps (MAP {} for none)
--   SET VARIABLE max_len = 2048;  SET VARIABLE overflow = 'truncate';  -- or 'drop'
--   SET VARIABLE seed = '0';      SET VARIABLE num_shards = 2;
--   .read src/eagle3_data/sql/merge_row_keys.sql              -- merge_row_keys (merge_row_keys.py: numpy, same values)
--   .read src/eagle3_data/sql/merge_plan.sql
--   SELECT shard, count(*), sum(out_tokens) FROM merge_plan WHERE drop_reason IS NULL GROUP BY ALL ORDER BY 1;
--
-- Decisions, in this order (each row gets the first that applies; NULL = kept):
--   duplicate                       same input_ids as a row earlier in (dataset, sample_id) order
--   no_supervised_tokens            loss mask all zero
--   over_max_len                    longer than max_len and overflow = 'drop'
--   no_supervised_after_truncation  longer than max_len, overflow = 'truncate', and the first max_len
--                                   positions hold no supervised token
--   over_max_samples                beyond the dataset's cap, counted in the seeded shuffle order
-- Shuffle: rows are ordered by shuffle_key = md5(seed, dataset, sample_id), which depends only on the
-- sample, never on how many input files there are or their order. Shards are contiguous ranges of that
-- order; a row goes to shard floor(tokens_before_it * num_shards / total_tokens), so every shard holds
-- total/num_shards tokens give or take one sample.

CREATE OR REPLACE TEMP TABLE merge_keys AS
SELECT
    v.filename,
    v.file_row_number,
    v.dataset,
    v.sample_id,
    md5(getvariable('seed')::VARCHAR || chr(31) || v.dataset || chr(31) || v.sample_id) AS shuffle_key,
    k.content_key,
    k.mask_key,
    k.num_tokens,
    k.num_supervised,
    k.num_supervised_cut
FROM read_parquet(getvariable('validated_files'), filename = true, file_row_number = true) AS v
JOIN merge_row_keys AS k ON k.filename = v.filename AND k.file_row_number = v.file_row_number
WHERE getvariable('datasets') IS NULL OR list_contains(getvariable('datasets'), v.dataset);

CREATE OR REPLACE TEMP TABLE merge_plan AS
WITH ranked AS (
    SELECT *,
        row_number() OVER (PARTITION BY content_key
                           ORDER BY dataset, sample_id, filename, file_row_number) AS dup_rank
    FROM merge_keys
), decided AS (
    SELECT *,
        CASE
            WHEN dup_rank > 1 THEN 'duplicate'
            WHEN num_supervised = 0 THEN 'no_supervised_tokens'
            WHEN num_tokens > getvariable('max_len') AND getvariable('overflow') = 'drop' THEN 'over_max_len'
            WHEN num_tokens > getvariable('max_len') AND num_supervised_cut = 0 THEN 'no_supervised_after_truncation'
        END AS reason0
    FROM ranked
), capped AS (
    SELECT *,
        row_number() OVER (PARTITION BY dataset, reason0 IS NULL ORDER BY shuffle_key) AS ds_rank
    FROM decided
), final AS (
    SELECT
        filename, file_row_number, dataset, sample_id, shuffle_key, content_key, mask_key, num_tokens, num_supervised,
        CASE
            WHEN reason0 IS NOT NULL THEN reason0
            WHEN ds_rank > coalesce(getvariable('max_samples')[dataset], 9223372036854775807) THEN 'over_max_samples'
        END AS drop_reason,
        num_tokens > getvariable('max_len') AS truncated,
        least(num_tokens, getvariable('max_len'))::BIGINT AS out_tokens,
        (CASE WHEN num_tokens > getvariable('max_len') THEN num_supervised_cut ELSE num_supervised END)::BIGINT
            AS out_supervised
    FROM capped
), cum AS (
    SELECT *,
        sum(out_tokens) OVER (ORDER BY shuffle_key ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
            - out_tokens AS tokens_before,
        sum(out_tokens) OVER () AS total_tokens
    FROM final
    WHERE drop_reason IS NULL
)
SELECT f.*,
    least(getvariable('num_shards') - 1,
          floor(c.tokens_before * getvariable('num_shards') / c.total_tokens))::BIGINT AS shard
FROM final f
LEFT JOIN cum c USING (filename, file_row_number);
