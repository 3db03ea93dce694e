-- limits: which limit ended each generated dataset (needs report_views.sql: responses, shard_summaries and
-- the dataset_limits table). stopped_by values, as generate writes them in its per-shard summary JSON:
--   all samples done | max_samples | budget_completion_tokens | budget_usd
-- ended_by: the shards' stopped_by ("x" when all agree, else "x (3 of 4 shards); y (1 of 4 shards)");
-- evidence: summary (every shard reported), partial summary (some did) or inferred (none did: the dataset's
-- spend against its limits, a budget counting as reached from 95% on, since generation stops new requests
-- when spent + in flight would reach it). other_model_replies: replies that named another model than the
-- backend's (a provider fallback), kept unless generation.reject_other_models.
WITH s AS (
    SELECT dataset, coalesce(stopped_by, 'unknown') AS stopped_by, count(*)::BIGINT AS n,
           sum(not_sent)::BIGINT AS not_sent, sum(over_max_samples)::BIGINT AS over_max_samples,
           sum(other_model_replies)::BIGINT AS other_model_replies
    FROM shard_summaries
    GROUP BY ALL
), st AS (
    SELECT dataset, sum(n)::BIGINT AS shards_reported, list(stopped_by ORDER BY n DESC, stopped_by) AS reasons,
           list(n ORDER BY n DESC, stopped_by) AS counts,
           sum(not_sent)::BIGINT AS not_sent, sum(over_max_samples)::BIGINT AS over_max_samples,
           sum(other_model_replies)::BIGINT AS other_model_replies
    FROM s
    GROUP BY dataset
), r AS (
    SELECT dataset,
           count(DISTINCT sample_id) FILTER (WHERE status = 'ok')::BIGINT AS samples_ok,
           count(*) FILTER (WHERE status <> 'ok')::BIGINT AS responses_failed,
           coalesce(sum(completion_tokens) FILTER (WHERE status = 'ok'), 0)::BIGINT AS completion_tokens,
           coalesce(sum(cost_usd), 0.0)::DOUBLE AS cost_usd
    FROM responses
    GROUP BY dataset
), names AS (
    SELECT dataset FROM dataset_limits UNION SELECT dataset FROM r UNION SELECT dataset FROM st
), j AS (
    SELECT n.dataset, l.shards, st.shards_reported, st.reasons, st.counts, st.not_sent, st.over_max_samples,
           st.other_model_replies,
           coalesce(r.samples_ok, 0) AS samples_ok, coalesce(r.responses_failed, 0) AS responses_failed,
           coalesce(r.completion_tokens, 0) AS completion_tokens, coalesce(r.cost_usd, 0.0) AS cost_usd,
           l.max_samples, l.budget_completion_tokens, l.budget_usd
    FROM names n
    LEFT JOIN dataset_limits l USING (dataset)
    LEFT JOIN st USING (dataset)
    LEFT JOIN r USING (dataset)
)
SELECT
    dataset,
    CASE
        WHEN shards_reported IS NOT NULL AND len(reasons) = 1 AND shards_reported = coalesce(shards, shards_reported)
            THEN reasons[1]
        WHEN shards_reported IS NOT NULL THEN array_to_string(list_transform(list_zip(reasons, counts),
            lambda x: x[1] || ' (' || x[2] || ' of ' || coalesce(shards, shards_reported) || ' shards)'), '; ')
        WHEN budget_usd IS NOT NULL AND cost_usd >= 0.95 * budget_usd THEN 'budget_usd'
        WHEN budget_completion_tokens IS NOT NULL AND completion_tokens >= 0.95 * budget_completion_tokens
            THEN 'budget_completion_tokens'
        WHEN max_samples IS NOT NULL AND samples_ok + responses_failed >= max_samples THEN 'max_samples'
        WHEN samples_ok + responses_failed > 0 THEN 'all samples done'
        ELSE 'not generated'
    END AS ended_by,
    CASE
        WHEN shards_reported IS NULL THEN 'inferred'
        WHEN shards_reported < coalesce(shards, shards_reported) THEN 'partial summary'
        ELSE 'summary'
    END AS evidence,
    shards,
    coalesce(shards_reported, 0)::BIGINT AS shards_reported,
    samples_ok,
    responses_failed,
    not_sent,
    over_max_samples,
    coalesce(other_model_replies, 0)::BIGINT AS other_model_replies,
    max_samples,
    completion_tokens,
    budget_completion_tokens,
    cost_usd,
    budget_usd
FROM j
ORDER BY dataset
