-- merge_plan: one row per validated sample with the merge decision and, when kept, its merged shard (training)
-- or the held-out set.
--
-- Run by hand (duckdb CLI, from the repo root):
--   SET VARIABLE validated_files = ['results/ds_a/validated/000.parquet', 'results/ds_b/validated/000.parquet'];
--   SET VARIABLE datasets = NULL::VARCHAR[];                 -- NULL = every dataset, else a list of names
--   SET VARIABLE max_samples = MAP(['ds_a'], [100]::BIGINT[]); -- per-dataset caps (MAP {} for none)
--   SET VARIABLE max_len = 2048;  SET VARIABLE overflow = 'truncate';  -- or 'drop'
--   SET VARIABLE seed = '0';      SET VARIABLE num_shards = 2;
--   SET VARIABLE heldout = 0.0::DOUBLE;                        -- held-out share (0: off)
--   CREATE TEMP TABLE prompt_keys AS SELECT dataset, sample_id, prompt_key  -- the held-out draw's keys
--       FROM read_parquet(['results/ds_a/prompts/000.parquet', 'results/ds_b/prompts/000.parquet']);
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
--   (held out)                      kept, in the held-out set (heldout = true, drop_reason NULL): a row no rule
--                                   above drops whose draw is below the share (see Held-out below)
--   over_max_samples                beyond the dataset's cap, counted in the seeded shuffle order among the
--                                   training rows only (held-out rows are neither counted nor capped)
-- Held-out: heldout_draw = the first 8 hex digits of md5(seed || chr(31) || 'heldout' || chr(31) || key) as
-- an integer, key = the prompt_key of the row's prompt (table prompt_keys: dataset, sample_id, prompt_key of the
-- PROMPTS files; the normalized user text, so copies of one prompt under other ids or in other datasets go the
-- same way), else (pre-tokenized rows) base_id; base_id = sample_id without a trailing '@<turn>' (generation mode
-- `all`: every turn of a conversation goes the same way); a row is held out when heldout_draw / 2^32 < heldout.
-- The draw depends on (seed, key) only: not on the dataset, the other rows or the shard counts (adding data moves
-- no sample in or out). Off (heldout = 0): no row, no md5.
-- Shuffle: rows are ordered by shuffle_key = md5(seed, dataset, sample_id), which depends only on the
-- sample, never on how many input files there are or their order. Shards are contiguous ranges of that
-- order over the training rows; a row goes to shard floor(tokens_before_it * num_shards / total_tokens), so
-- every shard holds total/num_shards tokens give or take one sample. A held-out row gets shard = num_shards
-- (the writer's output after the training shards: the held-out file, in the same shuffle_key order); a
-- dropped row NULL. Kept rows of both sets are in the selections (drop_reason IS NULL): extraction covers both.

-- the held-out draw's keys: none unless the caller filled it (then the draw is by base_id, as before prompt keys)
CREATE TEMP TABLE IF NOT EXISTS prompt_keys (dataset VARCHAR, sample_id VARCHAR, prompt_key VARCHAR);

CREATE OR REPLACE TEMP TABLE merge_keys AS
SELECT
    v.filename,
    v.file_row_number,
    v.dataset,
    v.sample_id,
    md5(getvariable('seed')::VARCHAR || chr(31) || v.dataset || chr(31) || v.sample_id) AS shuffle_key,
    CASE WHEN getvariable('heldout') > 0 THEN
        ('0x' || substr(md5(getvariable('seed')::VARCHAR || chr(31) || 'heldout' || chr(31)
                            || coalesce(p.prompt_key, regexp_replace(v.sample_id, '@[0-9]+$', ''))), 1, 8))::UBIGINT
    END AS heldout_draw,
    k.content_key,
    k.mask_key,
    k.num_tokens,
    k.num_supervised,
    k.num_supervised_cut
FROM read_parquet(getvariable('validated_files'), filename = true, file_row_number = true) AS v
JOIN merge_row_keys AS k ON k.filename = v.filename AND k.file_row_number = v.file_row_number
LEFT JOIN prompt_keys AS p ON p.dataset = v.dataset AND p.sample_id = regexp_replace(v.sample_id, '@[0-9]+$', '')
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
        END AS reason0,
        coalesce(heldout_draw < getvariable('heldout') * 4294967296.0, false) AS drawn
    FROM ranked
), capped AS (
    SELECT *,
        reason0 IS NULL AND drawn AS heldout,
        -- the cap counts training rows only: held-out rows are ranked apart
        row_number() OVER (PARTITION BY dataset, reason0 IS NULL AND NOT drawn ORDER BY shuffle_key) AS ds_rank
    FROM decided
), final AS (
    SELECT
        filename, file_row_number, dataset, sample_id, shuffle_key, content_key, mask_key, num_tokens, num_supervised,
        CASE
            WHEN reason0 IS NOT NULL THEN reason0
            WHEN heldout THEN NULL
            WHEN ds_rank > coalesce(getvariable('max_samples')[dataset], 9223372036854775807) THEN 'over_max_samples'
        END AS drop_reason,
        heldout,
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
    WHERE drop_reason IS NULL AND NOT heldout
)
SELECT f.*,
    (CASE
        WHEN f.drop_reason IS NOT NULL THEN NULL
        WHEN f.heldout THEN getvariable('num_shards')
        ELSE least(getvariable('num_shards') - 1, floor(c.tokens_before * getvariable('num_shards') / c.total_tokens))
    END)::BIGINT AS shard
FROM final f
LEFT JOIN cum c USING (filename, file_row_number);
