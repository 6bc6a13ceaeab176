"""The attribute names of pagedkv.Plan's arrays and of pagedkv.Stats, for tests that compare or
snapshot every one of them."""

STATS_FIELDS = (
    "num_blocks",
    "num_free",
    "num_cached",
    "num_held",
    "usage",
    "token_usage",
    "stored_tokens",
    "prefix_query_tokens",
    "prefix_hit_tokens",
    "prefix_allowed_tokens",
    "evictions",
    "computed_tokens",
    "pending_tokens",
    "external_query_tokens",
    "external_hit_tokens",
    "external_failures",
)
PLAN_ARRAYS = (
    "kv_indptr",
    "kv_indices",
    "kv_last_page_len",
    "qo_indptr",
    "slot_mapping",
    "positions",
    "block_tables",
    "copies",
    "state_slots",
    "state_copies",
    "state_resets",
    "state_saves",
)
