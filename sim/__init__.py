"""Cluster simulator: vLLM's own scheduler with vToken's patches on a virtual clock, a
step-time model, workloads, and the control plane's router and admission reused."""
