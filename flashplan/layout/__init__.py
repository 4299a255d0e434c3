"""Host-side records that describe a batch: layout, groups, heads, page table."""

from flashplan.layout.batch import BatchLayout, Mode
from flashplan.layout.group import AttentionGroup
from flashplan.layout.heads import HeadConfig
from flashplan.layout.page_table import PageTable

__all__ = ["AttentionGroup", "BatchLayout", "HeadConfig", "Mode", "PageTable"]
