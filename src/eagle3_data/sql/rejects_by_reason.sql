-- rejects_by_reason: rejected samples per dataset, stage and reason code (needs report_views.sql).
SELECT dataset, stage, reason, count(*)::BIGINT AS count
FROM rejected
GROUP BY ALL
ORDER BY dataset, stage, count DESC, reason
