"""The expert store: routed experts streamed from the container into a budgeted cache.

``ExpertStore`` (pinned set from ``.coli_usage`` + LRU + background reads), the usage-history
file in upstream's format (:mod:`.usage`), router top-p over the selected experts
(:mod:`.router_topp`). docs/streaming.md describes the options and the measurements.
"""

from .prefetch import ReadPool
from .router_topp import expert_top_p, set_expert_top_p
from .store import (ExpertLayout, ExpertStore, ExpertStoreError, LayerExperts, format_stats, plan_expert,
                    process_memory, resident_bytes)
from .usage import USAGE_FILE, UsageError, UsageHistory, engine_id, read_usage, write_usage

__all__ = [
    "ExpertLayout", "ExpertStore", "ExpertStoreError", "LayerExperts", "ReadPool", "USAGE_FILE", "UsageError",
    "UsageHistory", "engine_id", "expert_top_p", "format_stats", "plan_expert", "process_memory", "read_usage",
    "resident_bytes", "set_expert_top_p", "write_usage",
]
