"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` request contracts, in vLLM's shapes."""

from __future__ import annotations

from typing import Any

from gateway.contracts.common import ContractModel, NonEmptyStr, validate_body


class LoadLoraAdapterRequest(ContractModel):
    lora_name: NonEmptyStr
    lora_path: NonEmptyStr  # a folder on the model servers (relative: under their SIE_MODEL_CACHE)
    model: NonEmptyStr | None = None  # the base model; required when several are served


class UnloadLoraAdapterRequest(ContractModel):
    lora_name: NonEmptyStr
    lora_int_id: int | None = None  # vLLM accepts it and ignores it
    model: NonEmptyStr | None = None


def parse_load_lora_request(body: Any) -> LoadLoraAdapterRequest:
    return validate_body(LoadLoraAdapterRequest, body)


def parse_unload_lora_request(body: Any) -> UnloadLoraAdapterRequest:
    return validate_body(UnloadLoraAdapterRequest, body)
