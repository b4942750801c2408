"""Integrations of hybridkv's managers into serving engines (vLLM 0.33: ``.vllm``)."""
