"""The step loop: admission, the step plan, KV slots, sequences, prefix cache, output processing."""
