-- rejects_by_reason: rejected samples per dataset, stage and reason code, with the most common detail as an
-- example (e.g. the backend's error text of a failed request) (needs report_views.sql).
SELECT dataset, stage, reason, count(*)::BIGINT AS count, left(mode(detail), 300) AS example
FROM rejected
GROUP BY ALL
ORDER BY dataset, stage, count DESC, reason
