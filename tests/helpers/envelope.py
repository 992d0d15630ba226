"""What every fuzzed answer must be (the schemathesis tests against the stub and the real model): below 500, and a
4xx in the error envelope whose code the `X-SIE-Error-Code` header repeats. The one 5xx a client may cause is the
contract's 503 for a machine profile no pool has (docs/contract.md, "Capacity and routing errors")."""

from __future__ import annotations


def check_fuzzed_answer(response) -> None:
    """`response`: a schemathesis response (its header values are lists)."""
    if response.status_code == 503 and response.json()["error"]["param"] == "X-SIE-MACHINE-PROFILE":
        return
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}
        headers = {k.lower(): v if isinstance(v, str) else v[0] for k, v in response.headers.items()}
        assert headers["x-sie-error-code"] == error["code"]
