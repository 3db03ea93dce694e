-- timeline: one row per response with a completion time, in completion order: minutes since the first
-- response of the run (completed_at is unix seconds), its dataset, status, completion tokens and cost
-- (needs the responses view of report_views.sql). Used by plots.py for completion length against
-- completion time and cost over time.
SELECT dataset, status,
       (completed_at - min(completed_at) OVER ()) / 60.0 AS minutes_from_start,
       coalesce(completion_tokens, 0)::BIGINT AS completion_tokens,
       coalesce(cost_usd, 0.0)::DOUBLE AS cost_usd
FROM responses
WHERE completed_at IS NOT NULL
ORDER BY completed_at, dataset
