-- tally: the per-dataset table (needs the views of report_views.sql and backend_kinds).
-- samples, prompt_tokens (unsupervised: prompt and context), completion_tokens (supervised: loss mask 1),
-- total_tokens over the VALIDATED rows; the backends that produced them and where they run
-- (backend_kinds.location: local | remote); original_samples: rows whose answer is the dataset's own
-- (backend 'original': answers: original, no request, no cost); how many samples were rejected (any stage);
-- responses and dollars spent (every response, failed ones included).
WITH v AS (
    SELECT
        dataset,
        count(*)::BIGINT AS samples,
        sum(len(input_ids))::BIGINT AS total_tokens,
        sum(coalesce(list_sum(loss_mask), 0))::BIGINT AS completion_tokens,
        count(*) FILTER (WHERE ids_source = 'pretokenized')::BIGINT AS pretokenized_samples,
        count(*) FILTER (WHERE backend = 'original' AND ids_source <> 'pretokenized')::BIGINT AS original_samples,
        list(DISTINCT backend ORDER BY backend) FILTER (WHERE backend IS NOT NULL AND ids_source <> 'pretokenized')
            AS backends,
        list(DISTINCT coalesce(k.location, 'unknown') ORDER BY coalesce(k.location, 'unknown'))
            FILTER (WHERE backend IS NOT NULL AND ids_source <> 'pretokenized') AS locations
    FROM validated
    LEFT JOIN backend_kinds AS k USING (backend)
    GROUP BY dataset
), r AS (
    SELECT dataset, count(*)::BIGINT AS rejected FROM rejected GROUP BY dataset
), c AS (
    SELECT dataset,
        count(*) FILTER (WHERE status = 'ok')::BIGINT AS responses_ok,
        count(*) FILTER (WHERE status <> 'ok')::BIGINT AS responses_failed,
        coalesce(sum(cost_usd), 0)::DOUBLE AS cost_usd
    FROM responses
    GROUP BY dataset
)
SELECT
    dataset,
    coalesce(v.samples, 0) AS samples,
    coalesce(v.total_tokens - v.completion_tokens, 0) AS prompt_tokens,
    coalesce(v.completion_tokens, 0) AS completion_tokens,
    coalesce(v.total_tokens, 0) AS total_tokens,
    coalesce(v.pretokenized_samples, 0) AS pretokenized_samples,
    coalesce(v.original_samples, 0) AS original_samples,
    coalesce(v.backends, []) AS backends,
    coalesce(v.locations, []) AS locations,
    coalesce(r.rejected, 0) AS rejected,
    coalesce(c.responses_ok, 0) AS responses_ok,
    coalesce(c.responses_failed, 0) AS responses_failed,
    coalesce(c.cost_usd, 0.0) AS cost_usd
FROM v
FULL JOIN r USING (dataset)
FULL JOIN c USING (dataset)
ORDER BY dataset
