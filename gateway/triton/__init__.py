"""Everything that speaks Triton's gRPC protocol; no tritonclient type escapes this package."""
