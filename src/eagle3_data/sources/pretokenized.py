"""Pre-tokenized sources ("A-type"): rows that already hold target-tokenizer ``input_ids`` + ``loss_mask``.

Such rows skip generation: normalize writes them straight to TOKENS rows (``ids_source="pretokenized"``).
Record: ``{"sample_id" | "id": str (optional), "input_ids": [int], "loss_mask": [0|1]}`` (field names are
options). Only structural breakage is rejected here (empty ids, length mismatch, non-integer ids, ids outside
[0, 2**31-1], mask values other than 0/1); content checks (vocabulary size, at least one supervised token,
end-of-turn) belong to the validate stage.
"""

from __future__ import annotations

from typing import Any

from .base import Adapter, RowReject, Sample

INT32_MAX = 2**31 - 1


class Pretokenized(Adapter):
    name = "pretokenized"
    output = "tokens"
    required_key = "input_ids"
    expected = "a pre-tokenized record with `input_ids` and `loss_mask` lists"
    option_defaults: dict[str, Any] = {
        "id_field": None,  # None: `sample_id`, else `id`, else content hash
        "ids_field": "input_ids",
        "mask_field": "loss_mask",
    }

    def shape_problem(self, record: Any) -> str | None:
        if not isinstance(record, dict):
            return f"got a {type(record).__name__}, not an object"
        missing = [k for k in (self.options["ids_field"], self.options["mask_field"]) if k not in record]
        if missing:
            return f"missing {missing}; got keys {sorted(record)[:12]}"
        return None

    def convert(self, record: dict) -> Sample:
        field = self.options["id_field"]
        if field:
            sid = record.get(field)
        else:
            sid = record.get("sample_id", record.get("id"))
        sid = str(sid) if sid not in (None, "") else None
        ids = record[self.options["ids_field"]]
        mask = record[self.options["mask_field"]]
        if not isinstance(ids, (list, tuple)):
            raise RowReject("non_integer_id", f"input_ids is a {type(ids).__name__}, not a list", sid)
        if not isinstance(mask, (list, tuple)):
            raise RowReject("invalid_mask_value", f"loss_mask is a {type(mask).__name__}, not a list", sid)
        if len(ids) == 0:
            raise RowReject("empty_input_ids", "input_ids is empty", sid)
        if len(ids) != len(mask):
            raise RowReject("length_mismatch", f"{len(ids)} input_ids vs {len(mask)} loss_mask values", sid)
        for i, v in enumerate(ids):
            if type(v) is not int:  # bool is an int subclass: rejected on purpose
                raise RowReject("non_integer_id", f"input_ids[{i}] = {v!r}", sid)
            if v < 0 or v > INT32_MAX:
                raise RowReject("id_out_of_range", f"input_ids[{i}] = {v}", sid)
        clean_mask = []
        for i, v in enumerate(mask):
            if v is True or v is False:
                v = int(v)
            if type(v) is not int or v not in (0, 1):
                raise RowReject("invalid_mask_value", f"loss_mask[{i}] = {v!r}", sid)
            clean_mask.append(v)
        return Sample(sid, input_ids=list(ids), loss_mask=clean_mask)
