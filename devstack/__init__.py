"""Local development stack: launch tritonserver (system or bundled) and the gateway, for `make serve` and tests."""
