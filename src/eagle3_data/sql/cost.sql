-- cost: responses, billed tokens and dollars by dataset, backend and provider, with $ per million tokens
-- (needs the responses view of report_views.sql; run that first, then `.read src/eagle3_data/sql/cost.sql`).
-- Tokens here are the backends' billed usage per request (prompt_tokens = the whole prompt sent, counted
-- again for every request), not the validated sample tokens of tally.sql. Failed responses count in
-- responses_failed and in cost_usd (whatever the backend billed), never in the tokens.
-- level: detail = one (dataset, backend, provider); dataset = one dataset over its backends;
--        backend = one (backend, provider) over all datasets; total = everything. '(all)' marks a summed label.
WITH r AS (
    SELECT dataset, coalesce(backend, '(none)') AS backend, coalesce(provider, '(none)') AS provider, status,
           CASE WHEN status = 'ok' THEN coalesce(prompt_tokens, 0) ELSE 0 END AS prompt_tokens,
           CASE WHEN status = 'ok' THEN coalesce(completion_tokens, 0) ELSE 0 END AS completion_tokens,
           coalesce(cost_usd, 0.0) AS cost_usd
    FROM responses
), g AS (
    SELECT
        CASE WHEN grouping(dataset) = 1 THEN '(all)' ELSE dataset END AS dataset,
        CASE WHEN grouping(backend) = 1 THEN '(all)' ELSE backend END AS backend,
        CASE WHEN grouping(provider) = 1 THEN '(all)' ELSE provider END AS provider,
        CASE grouping(dataset, backend, provider)
            WHEN 0 THEN 'detail' WHEN 3 THEN 'dataset' WHEN 4 THEN 'backend' ELSE 'total' END AS level,
        grouping(dataset) AS g_dataset,
        grouping(backend, provider) AS g_backend,
        count(*) FILTER (WHERE status = 'ok')::BIGINT AS responses_ok,
        count(*) FILTER (WHERE status <> 'ok')::BIGINT AS responses_failed,
        sum(prompt_tokens)::BIGINT AS prompt_tokens,
        sum(completion_tokens)::BIGINT AS completion_tokens,
        sum(prompt_tokens + completion_tokens)::BIGINT AS total_tokens,
        sum(cost_usd)::DOUBLE AS cost_usd
    FROM r
    GROUP BY GROUPING SETS ((dataset, backend, provider), (dataset), (backend, provider), ())
)
SELECT dataset, backend, provider, level, responses_ok, responses_failed, prompt_tokens, completion_tokens,
       total_tokens, cost_usd,
       cost_usd * 1e6 / nullif(completion_tokens, 0) AS usd_per_m_completion_tokens,
       cost_usd * 1e6 / nullif(total_tokens, 0) AS usd_per_m_tokens
FROM g
-- an empty responses view still gives the (zero) total row
ORDER BY g_dataset, dataset, g_backend, backend, provider
