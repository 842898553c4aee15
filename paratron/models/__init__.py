"""The model family: one transformer (GPT-2 and Llama styles) built from paratron's parallel layers.

Modules: :mod:`.spec` (derived sizes and layout checks), :mod:`.rope`, :mod:`.attention`,
:mod:`.mlp`, :mod:`.embedding`, :mod:`.layer`, :mod:`.gpt` (pipeline model chunks),
:mod:`.recompute`, :mod:`.presets`, :mod:`.flops`; :mod:`.moe` (the MoE MLP). Nothing is imported here, so one broken module only breaks what uses it.
"""
