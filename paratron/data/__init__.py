"""Data pipeline: Megatron-compatible indexed ``.bin``/``.idx`` files, tokenizers, the
``paratron preprocess`` command, GPT sample datasets with splits and blending, and the
resumable pretraining sampler.

Modules: :mod:`.indexed` (file format), :mod:`.tokenizer`, :mod:`.corpus` (reading JSONL/text with
line-exact errors), :mod:`.preprocess` (the command), :mod:`.gpt_dataset` (samples, splits,
blending), :mod:`.blending`, :mod:`.sampler`, :mod:`.prepare` (first-use preprocessing for training).
This package imports nothing of paratron except :mod:`paratron.config`; importing it is cheap.
"""
