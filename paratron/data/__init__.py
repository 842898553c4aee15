"""Data pipeline: Megatron-compatible indexed ``.bin``/``.idx`` files, tokenizers, the
``paratron preprocess`` command, GPT sample datasets with splits and blending, and the
resumable pretraining sampler.

Modules: :mod:`.indexed` (the file format), :mod:`.tokenizer`, :mod:`.corpus` (reading JSONL/text
with line-exact errors), :mod:`.workers` (ordered process pool), :mod:`.preprocess` (the command),
:mod:`.gpt_dataset` (samples and splits), :mod:`.index_cache`, :mod:`.blending`, :mod:`.sampler`
(resumable per-rank microbatches), :mod:`.prepare` (first-use preprocessing for training),
:mod:`.paths` (bundled files).
This package imports nothing of paratron except :mod:`paratron.config`; importing it is cheap.
"""
