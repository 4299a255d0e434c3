"""Host-side records that describe a batch: layout, groups, heads, page table."""

from flashplan.layout.batch import BatchLayout, Mode
from flashplan.layout.draft_decode import DraftDecode
from flashplan.layout.drafts import DraftTree
from flashplan.layout.group import AttentionGroup
from flashplan.layout.heads import HeadConfig
from flashplan.layout.items import ItemDelimiters
from flashplan.layout.page_table import PageTable

__all__ = [
    "AttentionGroup",
    "BatchLayout",
    "DraftDecode",
    "DraftTree",
    "HeadConfig",
    "ItemDelimiters",
    "Mode",
    "PageTable",
]
