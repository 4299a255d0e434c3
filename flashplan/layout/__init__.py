"""Host-side records that describe a batch: layout, groups, heads, page table.

**Hostile input: the rules of every record a user builds.** :class:`BatchLayout`,
:class:`AttentionGroup`, :class:`HeadConfig`, :class:`DraftTree`,
:class:`ItemDelimiters`, :class:`DraftDecode`, :class:`PageTable`,
:class:`~flashplan.ShareLevel` and :class:`~flashplan.SharedPrefix` check their input in
attrs' ``__init__``: a converter per field, then the fields against each other. So a
named constructor, ``Record(...)`` and ``attrs.evolve(record, ...)`` (and
:meth:`BatchLayout.replace`) accept and refuse the same input, and no invalid record
exists for :func:`~flashplan.plan` to meet.

- Integer settings (page size, head counts, windows …) are Python or numpy integers;
  bools, floats (``2.0`` too), strings and ``None`` are refused. Real settings (soft
  cap, scale) are finite real numbers; flags are bools.
- Per-request lengths are 1-D: a sequence of ints, an integer (or integral float) numpy
  array or a CPU tensor. Refused, naming the first offending request: bools,
  non-integral or non-finite floats, strings, ``None``, nested lists, values outside
  int32 and negative lengths; device tensors (reading one would sync). What is accepted
  is stored as a read-only int32 copy (a read-only int32 array that owns its data is
  kept as it is).
- The rules between fields are checked on every path: one entry per request
  everywhere, ``prefix_lens <= seq_lens``, one new token per request in a decode, a
  draft in a verify batch only (its ``N`` tokens per request), delimiters in an extend
  only (sorted, distinct, below the request's new tokens), a cross group only with
  ``encoder_lens``, distinct groups.
- Totals that a plan indexes with int32 must fit int32, and a layout that breaks one is
  refused when it is built: the new tokens of all requests and the pages of all rows
  (named ``seq_lens``, with the total; each row's end too), the encoder tokens written
  in a step (``encoder_lens``). So no property of an accepted layout raises
  (:attr:`BatchLayout.pages_needed` included), and :func:`~flashplan.plan` meets no
  total beyond int32.
- Every refusal is a :class:`~flashplan.FlashplanError` (a ``ValueError``):
  :class:`~flashplan.LayoutError`, :class:`~flashplan.FieldTypeError` for a wrong type
  (also a ``TypeError``), :class:`~flashplan.PageTableError` for a page table. Its
  ``field`` names the field, ``request`` the first offending request where there is
  one, ``values`` the offending values.

The plan records (:class:`~flashplan.PlanSpec` and its parts, ``Lengths``,
``PageSpans``) are the planner's output: their named constructors (``PlanSpec.of`` …)
check, while their ``__init__`` and ``attrs.evolve`` store what they are given.
"""

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
