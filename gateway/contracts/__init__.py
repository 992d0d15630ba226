"""Request contracts: strict pydantic schemas that turn wire JSON into a `GenerationRequest`."""
