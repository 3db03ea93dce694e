-- report_views: the views every report query reads. Run by hand (duckdb CLI, repo root):
--   SET VARIABLE validated_files = 'results/*/validated/*.parquet';   -- a glob or a list of paths
--   SET VARIABLE rejected_files  = 'results/*/rejected/*.parquet';
--   SET VARIABLE responses_files = 'results/*/responses/*.parquet';
--   CREATE TEMP TABLE backend_kinds AS SELECT * FROM (VALUES ('tiny_local', 'local')) t(backend, location);
--   .read src/eagle3_data/sql/report_views.sql
--   .read src/eagle3_data/sql/tally.sql
-- (report.py registers an empty table of the right schema instead when a file list is empty.)
CREATE OR REPLACE TEMP VIEW validated AS SELECT * FROM read_parquet(getvariable('validated_files'));
CREATE OR REPLACE TEMP VIEW rejected AS SELECT * FROM read_parquet(getvariable('rejected_files'));
CREATE OR REPLACE TEMP VIEW responses AS SELECT * FROM read_parquet(getvariable('responses_files'));
