-- merge_row_keys: per validated row, what the merge plan needs of its token lists: md5 of input_ids and of
-- loss_mask as DuckDB writes them as VARCHAR ('[1, 2, 3]'; the selections' digests are built from these),
-- the length, the supervised tokens and the supervised tokens within the first max_len positions.
-- merge_row_keys.py computes the same values with numpy (row_keys, checked against this query by
-- tests/unit/test_merge_row_keys.py) and falls back to this query for a file it cannot (nulls, ids >= 10^6 or < 0, mask values
-- outside 0..9). By hand (duckdb CLI), before merge_plan.sql (same variables):
--   .read src/eagle3_data/sql/merge_row_keys.sql
-- Rows with images (VALIDATED `images`) then get their image digests folded into content_key
-- (merge/keys.py add_image_keys), so the same ids with other images are no duplicate.
CREATE OR REPLACE TEMP TABLE merge_row_keys AS
SELECT
    filename,
    file_row_number,
    md5(input_ids::VARCHAR) AS content_key,
    md5(loss_mask::VARCHAR) AS mask_key,
    len(input_ids)::BIGINT AS num_tokens,
    coalesce(list_sum(loss_mask), 0)::BIGINT AS num_supervised,
    (CASE WHEN len(loss_mask) > getvariable('max_len') THEN coalesce(list_sum(loss_mask[1:getvariable('max_len')]), 0)
          ELSE coalesce(list_sum(loss_mask), 0) END)::BIGINT AS num_supervised_cut
FROM read_parquet(getvariable('validated_files'), filename = true, file_row_number = true)
WHERE getvariable('datasets') IS NULL OR list_contains(getvariable('datasets'), dataset);
