"""The vToken control plane: tenant quotas, replica reports, the controller, admission and routing.

Runs on a CPU-only head node: nothing here imports vLLM or torch.
"""
