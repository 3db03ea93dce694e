-- merge_selection_rows: the kept rows grouped by the validated file they came from (its selection), in that
-- file's row order, truncated to max_len; `shard` is the selection's index in merge_sources. Extraction
-- forwards one selection per job; it holds the training and the held-out rows alike, so the held-out share
-- (merge.heldout) changes a selection only under a merge.max_samples cap (it counts training rows).
-- Needs merge_plan (merge_plan.sql) and merge_sources (see merge_rows.sql).
SELECT
    v.sample_id,
    v.dataset,
    CASE WHEN p.truncated THEN v.input_ids[1:getvariable('max_len')] ELSE v.input_ids END AS input_ids,
    CASE WHEN p.truncated THEN v.loss_mask[1:getvariable('max_len')] ELSE v.loss_mask END AS loss_mask,
    p.out_tokens AS num_tokens,
    p.out_supervised AS num_supervised,
    p.truncated,
    s.source,
    s.idx AS shard
FROM read_parquet(getvariable('validated_files'), filename = true, file_row_number = true) AS v
JOIN (SELECT * FROM merge_plan WHERE drop_reason IS NULL) AS p
  ON v.filename = p.filename AND v.file_row_number = p.file_row_number
JOIN merge_sources AS s ON s.filename = v.filename
ORDER BY s.idx, v.file_row_number
