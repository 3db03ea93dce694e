"""pandera DataFrameModels: the value checks of every stage's parquet contract (``schemas.check`` runs them).

Kept apart from ``schemas.py`` so that stages which only need the arrow schemas (generate, at 2,000 requests in
flight) don't import pandas and pandera.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import pandera.pandas as pa_pd
from pandera.typing import Series


# ---------------------------------------------------------------------------------------------------
# pandera models: value checks beyond the arrow types.


def _lists_ok(s: pd.Series, low: int, high: int | None = None) -> pd.Series:
    def ok(v) -> bool:
        if v is None:
            return False
        a = np.asarray(v)  # list cells arrive as numpy arrays from to_pandas: no per-element Python loop
        if not a.size:
            return False
        return bool(a.min() >= low and (high is None or a.max() <= high))

    return s.map(ok)


class PromptsModel(pa_pd.DataFrameModel):
    sample_id: Series[str] = pa_pd.Field(nullable=False, str_length={"min_value": 1})
    dataset: Series[str] = pa_pd.Field(nullable=False)
    messages: Series[str] = pa_pd.Field(nullable=False, str_startswith="[")
    tools: Series[str] = pa_pd.Field(nullable=True)
    source_format: Series[str] = pa_pd.Field(nullable=False)
    source_row: Series[int] = pa_pd.Field(ge=0)
    prompt_key: Series[str] = pa_pd.Field(nullable=True, str_length={"min_value": 16, "max_value": 16})

    class Config:
        unique = ["sample_id"]
        strict = True


class RejectsModel(pa_pd.DataFrameModel):
    sample_id: Series[str] = pa_pd.Field(nullable=True)
    dataset: Series[str] = pa_pd.Field(nullable=False)
    stage: Series[str] = pa_pd.Field(
        isin=["normalize", "decontaminate", "generate", "original_answers", "tokenize", "validate"]
    )
    reason: Series[str] = pa_pd.Field(nullable=False, str_length={"min_value": 1})
    detail: Series[str] = pa_pd.Field(nullable=True)
    source_row: Series[float] = pa_pd.Field(nullable=True, coerce=True)

    class Config:
        strict = True


class ResponsesModel(pa_pd.DataFrameModel):
    sample_id: Series[str] = pa_pd.Field(nullable=False)
    dataset: Series[str] = pa_pd.Field(nullable=False)
    turn: Series[int] = pa_pd.Field(ge=0, coerce=True)  # arrow int32
    request_key: Series[str] = pa_pd.Field(nullable=False)
    status: Series[str] = pa_pd.Field(isin=["ok", "failed"])
    completion_tokens: Series[float] = pa_pd.Field(nullable=True, ge=0, coerce=True)
    cost_usd: Series[float] = pa_pd.Field(nullable=True, ge=0)
    prompt_ids: Series[object] = pa_pd.Field(nullable=True)  # list<int32> or null (vLLM's prompt_token_ids)

    @pa_pd.check("prompt_ids")
    def _prompt_ids_non_empty(cls, s):
        """Server prompt ids, when present, are a non-empty list (the prompt always has tokens)."""
        return s.map(lambda v: v is None or len(v) > 0)

    class Config:
        unique = ["request_key"]


class TokensModel(pa_pd.DataFrameModel):
    sample_id: Series[str] = pa_pd.Field(nullable=False)
    dataset: Series[str] = pa_pd.Field(nullable=False)
    num_tokens: Series[int] = pa_pd.Field(ge=0)
    ids_source: Series[str] = pa_pd.Field(isin=["exact", "reconstructed", "pretokenized"], nullable=True)

    class Config:
        unique = ["sample_id"]


class ValidatedModel(pa_pd.DataFrameModel):
    sample_id: Series[str] = pa_pd.Field(nullable=False)
    dataset: Series[str] = pa_pd.Field(nullable=False)
    input_ids: Series[object] = pa_pd.Field(nullable=False)
    loss_mask: Series[object] = pa_pd.Field(nullable=False)
    num_tokens: Series[int] = pa_pd.Field(gt=0)
    num_completion_tokens: Series[int] = pa_pd.Field(gt=0)
    ids_source: Series[str] = pa_pd.Field(isin=["exact", "reconstructed", "pretokenized"])

    @pa_pd.check("input_ids")
    def ids_non_negative(cls, s: pd.Series) -> pd.Series:
        return _lists_ok(s, 0)

    @pa_pd.check("loss_mask")
    def mask_binary(cls, s: pd.Series) -> pd.Series:
        return _lists_ok(s, 0, 1)

    @pa_pd.dataframe_check
    def lengths_agree(cls, df: pd.DataFrame) -> pd.Series:
        return (df["input_ids"].map(len) == df["num_tokens"]) & (df["loss_mask"].map(len) == df["num_tokens"])

    class Config:
        unique = ["sample_id"]


class MergedModel(ValidatedModel):
    num_supervised: Series[int] = pa_pd.Field(gt=0)
    truncated: Series[bool]
    source: Optional[Series[str]] = pa_pd.Field(nullable=True)
    # merged rows carry no ids_source/num_completion_tokens columns
    ids_source: Optional[Series[str]]
    num_completion_tokens: Optional[Series[int]]

    class Config:
        # datasets from one source may share ids: a merged row is (dataset, sample_id), as its selection is
        unique = ["dataset", "sample_id"]


MODELS = {
    "prompts": PromptsModel,
    "rejects": RejectsModel,
    "responses": ResponsesModel,
    "tokens": TokensModel,
    "validated": ValidatedModel,
    "merged": MergedModel,
}
