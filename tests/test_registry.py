"""The one registry type behind schedules, token dispatchers and blocks: unknown names raise the
config error with did-you-mean, before any process group exists."""

import pytest

from paratron.config import ConfigError
from paratron.registry import Registry


def test_unknown_name_raises_config_error_with_did_you_mean():
    reg = Registry("widget", "model.widget")
    reg.register("alpha", 1)
    reg.register("beta", 2)
    with pytest.raises(ConfigError, match=r"model\.widget='alpah' is not a registered widget "
                                          r"\(did you mean 'alpha'\?\); known: alpha, beta"):
        reg.get("alpah")
    with pytest.raises(ConfigError) as far:
        reg.get("zzz")
    assert "did you mean" not in str(far.value)
    assert reg.get("beta") == 2 and "alpha" in reg and reg.names() == ["alpha", "beta"]


def test_register_refuses_a_taken_name_unless_replace():
    reg = Registry("widget", "model.widget")
    reg.register("a", 1)
    with pytest.raises(ValueError, match="'a' is already registered"):
        reg.register("a", 1)
    reg.register("a", 2, replace=True)
    assert reg.get("a") == 2
    reg.unregister("a")
    with pytest.raises(ConfigError):
        reg.get("a")
    with pytest.raises(ValueError, match="non-empty string"):
        reg.register("", 3)


@pytest.mark.parametrize("lookup, field, typo, want", [
    ("paratron.pipeline.registry:get_schedule", "parallel.schedule", "1fb1", "1f1b"),
    ("paratron.models.moe.dispatcher:get_dispatcher", "model.moe_token_dispatcher", "alltoal", "alltoall"),
    ("paratron.models.blocks:BLOCKS.get", "model.block", "transformr", "transformer"),
])
def test_every_registry_shares_the_error(lookup, field, typo, want):
    import importlib

    module, _, attr = lookup.partition(":")
    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    with pytest.raises(ConfigError, match=rf"{field}='{typo}'.*did you mean '{want}'"):
        fn(typo)
