"""The rule of ``model.activation_offload``, a pure check on config values, so that the config
validator runs it before launch and the model build (``paratron.models.offload``) shares it."""

from __future__ import annotations

MODULES = ("input_norm", "attention", "post_attention_norm", "mlp", "layer")
"""The submodules of a transformer layer whose saved activations can be offloaded."""


def check_activation_offload(names: list[str], recompute: str, compile_: bool) -> str | None:
    """The rule of ``model.activation_offload``: None when it holds, else the error text.

    Rules: every name is one of :data:`MODULES`, no name twice; not with ``model.recompute =
    "full"`` (the recomputed layer saves only its input, so there is nothing to offload); not
    with ``model.compile`` (the hooks are per-call Python that a compiled layer does not run).
    """
    bad = [n for n in names if n not in MODULES]
    if bad:
        return f"model.activation_offload={names}: unknown module(s) {bad}; choose from {list(MODULES)}"
    if len(set(names)) != len(names):
        return f"model.activation_offload={names} names a module twice"
    if names and recompute == "full":
        return (f"model.activation_offload={names} with model.recompute='full': a fully recomputed layer "
                "keeps only its input, so there is nothing to offload; use one of the two")
    if names and compile_:
        return f"model.activation_offload={names} is not supported with model.compile=true"
    return None
