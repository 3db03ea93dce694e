-- report_views: the views every report query reads. Run by hand (duckdb CLI, repo root), e.g.:
--   SET VARIABLE validated_files = 'results/*/validated/*.parquet';   -- a glob or a list of paths
--   SET VARIABLE rejected_files  = 'results/*/rejected/*.parquet';
--   SET VARIABLE responses_files = 'results/*/responses/*.parquet';
--   SET VARIABLE summary_files   = 'results/*/responses/*.json';      -- generate's per-shard summaries
--   CREATE TEMP TABLE backend_kinds AS SELECT * FROM (VALUES ('tiny_local', 'local')) t(backend, location);
--   CREATE TEMP TABLE dataset_limits AS SELECT * FROM (VALUES ('sharegpt_demo', 2, NULL, NULL, NULL))
--       t(dataset, shards, max_samples, budget_completion_tokens, budget_usd);   -- from config generation:
--   .read src/eagle3_data/sql/report_views.sql
--   .read src/eagle3_data/sql/tally.sql          -- or cost.sql, throughput.sql, limits.sql, ...
-- (report/db.py registers an empty table of the right schema instead when a file list is empty, and fills
-- backend_kinds / dataset_limits from the config.)
CREATE OR REPLACE TEMP VIEW validated AS
    SELECT * FROM read_parquet(getvariable('validated_files'), union_by_name = true);
CREATE OR REPLACE TEMP VIEW rejected AS
    SELECT * FROM read_parquet(getvariable('rejected_files'), union_by_name = true);
CREATE OR REPLACE TEMP VIEW responses AS
    SELECT * FROM read_parquet(getvariable('responses_files'), union_by_name = true);
-- One row per generate summary JSON; dataset and shard fall back to the file's path
-- (results/<dataset>/responses/<shard>.json) when the JSON lacks them.
CREATE OR REPLACE TEMP VIEW shard_summaries AS
    SELECT
        coalesce(dataset, regexp_extract(filename, '([^/\\]+)[/\\]responses[/\\][^/\\]+\.json$', 1)) AS dataset,
        coalesce(shard, regexp_extract(filename, '([^/\\]+)\.json$', 1)) AS shard,
        stopped_by, samples, ok, failed_total, not_sent, over_max_samples, other_model_replies, filename
    FROM read_json(getvariable('summary_files'), filename = true, columns = {
        dataset: 'VARCHAR', shard: 'VARCHAR', stopped_by: 'VARCHAR', samples: 'BIGINT', ok: 'BIGINT',
        failed_total: 'BIGINT', not_sent: 'BIGINT', over_max_samples: 'BIGINT', other_model_replies: 'BIGINT'});
