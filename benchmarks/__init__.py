"""tinygpt's benchmark suite: tinygpt and the implementations a user would pick instead, side by side.

Entry point: ``python -m benchmarks [--quick] [--json PATH] [--only CASES]`` (``benchmarks/runner.py``).
"""
