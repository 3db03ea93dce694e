-- merge_stats: per merged shard and dataset, the kept samples, tokens and supervised tokens; shard = num_shards
-- is the held-out set (needs the merge_plan table from merge_plan.sql).
SELECT shard, dataset,
       count(*)::BIGINT AS samples,
       sum(out_tokens)::BIGINT AS tokens,
       sum(out_supervised)::BIGINT AS supervised_tokens,
       count(*) FILTER (WHERE truncated)::BIGINT AS truncated
FROM merge_plan
WHERE drop_reason IS NULL
GROUP BY shard, dataset
ORDER BY shard, dataset
