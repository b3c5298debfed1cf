"""Models the way users bring them, for the examples, the benchmarks and the tests: the Hugging Face wrappers
(``hf``: ``HFLanguageModel``, ``HFTextDataModule``, ``build_hf_model``) and the embedded text corpus (``corpus``)."""
