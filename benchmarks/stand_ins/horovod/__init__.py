"""Horovod for Graphcore's applications under ``benchmarks/apps.py``: see ``torch.py``."""
