-- lengths: one row per validated sample: its prompt tokens (loss mask 0: prompt and context) and completion
-- tokens (loss mask 1: supervised), as counted by tally.sql (needs the validated view of report_views.sql).
-- Used by plots.py for the length distributions.
SELECT dataset,
       (len(input_ids) - coalesce(list_sum(loss_mask), 0))::BIGINT AS prompt_tokens,
       coalesce(list_sum(loss_mask), 0)::BIGINT AS completion_tokens
FROM validated
ORDER BY dataset
