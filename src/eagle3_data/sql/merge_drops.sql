-- merge_drops: per dataset, the input samples and how many the merge dropped, by reason
-- (needs the merge_plan table from merge_plan.sql).
SELECT dataset, coalesce(drop_reason, 'kept') AS decision, count(*)::BIGINT AS samples,
       sum(num_tokens)::BIGINT AS input_tokens
FROM merge_plan
GROUP BY ALL
ORDER BY dataset, decision
