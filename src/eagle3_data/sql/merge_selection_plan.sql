-- merge_selection_plan: per validated file (its index in merge_sources), the kept rows' file row numbers in
-- order with their merged lengths and truncation flag: what merge.py needs to write each selection straight from
-- its validated file (the same rows as merge_selection_rows.sql, without a join and a sort of the token lists).
-- Kept rows of both sets (training and held-out): extraction covers both.
-- Needs merge_plan (merge_plan.sql) and merge_sources (see merge_rows.sql).
SELECT s.idx, p.file_row_number, p.out_tokens, p.out_supervised, p.truncated
FROM merge_plan AS p
JOIN merge_sources AS s USING (filename)
WHERE p.drop_reason IS NULL
ORDER BY s.idx, p.file_row_number
