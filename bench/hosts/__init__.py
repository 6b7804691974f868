"""Tools for the offline GPU hosts: bundles of a vLLM release, their checks (README.md in this folder)."""
