"""Simulators of vLLM servers for tests, the demo and the benchmark."""
