-- merge_conflicts: (dataset, sample_id) pairs that occur with different input_ids (needs merge_keys from
-- merge_plan.sql). Any row here is an error: the same sample id must mean the same sample.
SELECT dataset, sample_id, count(DISTINCT content_key) AS versions, list(DISTINCT filename) AS files
FROM merge_keys
GROUP BY dataset, sample_id
HAVING count(DISTINCT content_key) > 1
ORDER BY dataset, sample_id
LIMIT 10
