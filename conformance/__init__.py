"""Conformance: golden vLLM traces, stateful differential models and symbolic checks."""
