-- merge_drops: per dataset, the input samples and how many the merge kept for training ('kept'), held out
-- ('heldout': kept, in the held-out set) and dropped, by reason (needs the merge_plan table from merge_plan.sql).
SELECT dataset, coalesce(drop_reason, CASE WHEN heldout THEN 'heldout' ELSE 'kept' END) AS decision,
       count(*)::BIGINT AS samples,
       sum(num_tokens)::BIGINT AS input_tokens
FROM merge_plan
GROUP BY ALL
ORDER BY dataset, decision
