-- merge_rows: the kept rows in merged-shard order (shard, then shuffle_key), truncated to max_len, with the
-- key of the validated shard each came from (its selection, whose hidden states hold the row's states). The
-- held-out rows come last, as shard = num_shards (merge.py writes them to the held-out file).
-- Needs the merge_plan table (run merge_plan.sql first with the same variables) and a merge_sources table
-- (filename VARCHAR, source VARCHAR, idx BIGINT) naming each validated file's selection, e.g. by hand:
--   CREATE TEMP TABLE merge_sources AS SELECT * FROM (VALUES
--     ('results/ds_a/validated/000.parquet', 'ds_a/000', 0)) t(filename, source, idx);
--   COPY (SELECT * EXCLUDE (shard) FROM (<this query>) WHERE shard = 0) TO 'merged_000.parquet';
SELECT
    v.sample_id,
    v.dataset,
    CASE WHEN p.truncated THEN v.input_ids[1:getvariable('max_len')] ELSE v.input_ids END AS input_ids,
    CASE WHEN p.truncated THEN v.loss_mask[1:getvariable('max_len')] ELSE v.loss_mask END AS loss_mask,
    p.out_tokens AS num_tokens,
    p.out_supervised AS num_supervised,
    p.truncated,
    s.source,
    p.shard
FROM read_parquet(getvariable('validated_files'), filename = true, file_row_number = true) AS v
JOIN (SELECT * FROM merge_plan WHERE drop_reason IS NULL) AS p
  ON v.filename = p.filename AND v.file_row_number = p.file_row_number
JOIN merge_sources AS s ON s.filename = v.filename
ORDER BY p.shard, p.shuffle_key
