"""Moving KV blocks between engines (prefill/decode disaggregation)."""
