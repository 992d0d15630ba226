"""Wire renderers: domain events in, contract JSON (blocking bodies and SSE chunks) out."""
