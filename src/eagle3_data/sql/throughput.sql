-- throughput: responses, completion tokens and dollars per time bucket of completed_at (unix seconds),
-- from the first response on, gaps included (needs the responses view of report_views.sql). Run by hand:
--   SET VARIABLE bucket_s = 60;     -- bucket length in seconds (report/write.py: 60 for the CSV, coarser
--   .read src/eagle3_data/sql/throughput.sql      -- for the Markdown so it stays under ~240 rows)
-- completion_tokens_per_min normalises each bucket to one minute; cumulative_mean_completion_tokens is
-- the mean completion length of every response finished so far (it climbs when long requests finish last).
WITH r AS (
    SELECT completed_at, status, coalesce(completion_tokens, 0) AS completion_tokens,
           coalesce(cost_usd, 0.0) AS cost_usd
    FROM responses
    WHERE completed_at IS NOT NULL
), t AS (
    SELECT floor(min(completed_at)) AS t0, max(completed_at) AS t1, getvariable('bucket_s')::DOUBLE AS bucket_s FROM r
), b AS (
    SELECT floor((r.completed_at - t.t0) / t.bucket_s)::BIGINT AS bucket,
           count(*) FILTER (WHERE status = 'ok')::BIGINT AS responses_ok,
           count(*) FILTER (WHERE status <> 'ok')::BIGINT AS responses_failed,
           coalesce(sum(completion_tokens) FILTER (WHERE status = 'ok'), 0)::BIGINT AS completion_tokens,
           sum(cost_usd)::DOUBLE AS cost_usd
    FROM r, t
    GROUP BY ALL
), s AS (
    SELECT range AS bucket FROM t, range(0, floor((t.t1 - t.t0) / t.bucket_s)::BIGINT + 1)
), f AS (
    SELECT s.bucket, coalesce(b.responses_ok, 0) AS responses_ok, coalesce(b.responses_failed, 0) AS responses_failed,
           coalesce(b.completion_tokens, 0) AS completion_tokens, coalesce(b.cost_usd, 0.0) AS cost_usd
    FROM s LEFT JOIN b USING (bucket)
)
SELECT
    make_timestamp(((t.t0 + f.bucket * t.bucket_s) * 1e6)::BIGINT) AS bucket_start_utc,
    f.bucket * t.bucket_s / 60.0 AS minutes_from_start,
    f.responses_ok,
    f.responses_failed,
    f.completion_tokens,
    f.completion_tokens * 60.0 / t.bucket_s AS completion_tokens_per_min,
    f.cost_usd,
    sum(f.completion_tokens) OVER w AS cumulative_completion_tokens,
    sum(f.cost_usd) OVER w AS cumulative_cost_usd,
    f.completion_tokens / nullif(f.responses_ok, 0) AS mean_completion_tokens,
    sum(f.completion_tokens) OVER w / nullif(sum(f.responses_ok) OVER w, 0) AS cumulative_mean_completion_tokens
FROM f, t
WINDOW w AS (ORDER BY f.bucket ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
ORDER BY f.bucket
