-- merge_selections: per validated file (selection), the kept samples and tokens and a digest of what its
-- hidden states depend on: sample ids, their full token ids and loss masks (md5 of each) and the kept length,
-- in file row order. Two merges that keep the same samples of a file with the same truncation give the same
-- digest, whatever else changed (merge.heldout included: held-out rows are kept rows of their selection; only
-- under a merge.max_samples cap, which counts training rows, does a new share admit other rows);
-- the extract rule re-runs a selection's job only when its digest changes.
-- Needs merge_plan (merge_plan.sql) and merge_sources (see merge_rows.sql).
SELECT
    s.idx,
    s.source,
    count(p.sample_id)::BIGINT AS samples,
    coalesce(sum(p.out_tokens), 0)::BIGINT AS tokens,
    sha256(coalesce(string_agg(
        p.sample_id || chr(31) || p.content_key || chr(31) || p.mask_key || chr(31) || p.out_tokens::VARCHAR,
        chr(30) ORDER BY p.file_row_number), '')) AS digest
FROM merge_sources AS s
LEFT JOIN (SELECT * FROM merge_plan WHERE drop_reason IS NULL) AS p USING (filename)
GROUP BY s.idx, s.source
ORDER BY s.idx
