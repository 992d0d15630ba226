"""Code the unit, integration and e2e tests share: SSE and Prometheus parsing, polling, the fuzzed answer check."""
