"""A model whose profile breaks contract/profile.py is not served, the log names the key, the others are served."""

from __future__ import annotations

import logging

from tests.integration.conftest import BASE_PARAMS, TRITON_MODEL, assert_error


async def test_a_model_with_a_bad_profile_key_is_not_served_and_the_others_are(make_gateway, caplog):
    def setup(fakes):
        fakes["a"].models = [(TRITON_MODEL, "READY", dict(BASE_PARAMS)),
                             ("typo", "READY", {"served_name": "x/typo", "max_output_token": "10"})]

    with caplog.at_level(logging.ERROR, logger="gateway.registry"):
        gw = await make_gateway(setup=setup)
        assert (await gw.generate()).status_code == 200
        assert_error(await gw.generate(model="x__typo"), 404, "model_not_found", "model", "model_not_found")
    (line,) = [r.getMessage() for r in caplog.records if "typo" in r.getMessage()]
    assert "`max_output_token`" in line and "`max_output_tokens`" in line
