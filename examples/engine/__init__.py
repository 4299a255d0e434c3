"""A small continuous-batching engine on flashplan and Hugging Face transformers.

Modules: ``hf_attention`` (HF -> flashplan conventions, the registered attention function),
``hf_models`` (tiny configs, loading, adapters), ``engine`` (scheduler, pages, step loop),
``overlap`` (the overlapped step loop's one-step-late bookkeeping), ``parity`` (check
against HF), ``run`` (command line). See docs/guide-engine.md.
"""
