-- audit: the backends' billed token counts against the target's own count of the same tokens, per dataset and
-- ids_source (needs the validated view of report_views.sql; run that first, then `.read .../audit.sql`).
-- completion: the completion ids (exact, or reconstructed from the text; end-of-turn included) vs
--   usage.completion_tokens. validate rejects a sample outside count_tolerance and fails a shard outside
--   aggregate_rel, so what is left here is within tolerance.
-- prompt: the prompt as the target's chat template renders it (num_prompt_tokens) vs usage.prompt_tokens.
--   Never a reject, only reported: a gap means the server rendered another prompt than the one the hidden
--   states will be computed on (a default system prompt, another template version, tools rendered another
--   way), so the completions were generated in a context the training data does not show. Exact ids from a
--   local SGLang /generate are rendered by us: their prompts agree by construction.
-- Validated generated samples only (pre-tokenized ones have no billing). level: detail = one (dataset,
-- ids_source); dataset = a dataset over its sources; total = everything ('(all)' marks a summed label).
-- *_rel = (billed - ours) / ours over the samples that carry that billed count.
WITH v AS (
    SELECT dataset, coalesce(ids_source, '(none)') AS ids_source, num_prompt_tokens, num_completion_tokens,
           billed_prompt_tokens, billed_completion_tokens
    FROM validated
    WHERE coalesce(ids_source, '') <> 'pretokenized'
), g AS (
    SELECT
        CASE WHEN grouping(dataset) = 1 THEN '(all)' ELSE dataset END AS dataset,
        CASE WHEN grouping(ids_source) = 1 THEN '(all)' ELSE ids_source END AS ids_source,
        CASE grouping(dataset, ids_source) WHEN 0 THEN 'detail' WHEN 1 THEN 'dataset' ELSE 'total' END AS level,
        grouping(dataset) AS g_dataset,
        grouping(ids_source) AS g_source,
        count(*)::BIGINT AS samples,
        count(billed_completion_tokens)::BIGINT AS completion_billed_samples,
        coalesce(sum(num_completion_tokens) FILTER (WHERE billed_completion_tokens IS NOT NULL), 0)::BIGINT
            AS completion_tokens,
        coalesce(sum(billed_completion_tokens), 0)::BIGINT AS billed_completion_tokens,
        count(*) FILTER (WHERE billed_completion_tokens = num_completion_tokens)::BIGINT AS completion_equal_samples,
        count(billed_prompt_tokens)::BIGINT AS prompt_billed_samples,
        coalesce(sum(num_prompt_tokens) FILTER (WHERE billed_prompt_tokens IS NOT NULL), 0)::BIGINT AS prompt_tokens,
        coalesce(sum(billed_prompt_tokens), 0)::BIGINT AS billed_prompt_tokens,
        count(*) FILTER (WHERE billed_prompt_tokens = num_prompt_tokens)::BIGINT AS prompt_equal_samples,
        median(billed_prompt_tokens - num_prompt_tokens)::DOUBLE AS prompt_diff_median,
        min(billed_prompt_tokens - num_prompt_tokens)::BIGINT AS prompt_diff_min,
        max(billed_prompt_tokens - num_prompt_tokens)::BIGINT AS prompt_diff_max
    FROM v
    GROUP BY GROUPING SETS ((dataset, ids_source), (dataset), ())
)
SELECT dataset, ids_source, level, samples,
       completion_billed_samples, completion_tokens, billed_completion_tokens,
       (billed_completion_tokens - completion_tokens) / nullif(completion_tokens, 0)::DOUBLE AS completion_rel,
       completion_equal_samples,
       prompt_billed_samples, prompt_tokens, billed_prompt_tokens,
       (billed_prompt_tokens - prompt_tokens) / nullif(prompt_tokens, 0)::DOUBLE AS prompt_rel,
       prompt_equal_samples, prompt_diff_median, prompt_diff_min, prompt_diff_max
FROM g
-- an empty validated view still gives the (zero) total row
ORDER BY g_dataset, dataset, g_source, ids_source
