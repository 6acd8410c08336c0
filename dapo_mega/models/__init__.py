"""Models: the one model-shape record (shape.py, read from an HF config) and the tiny model of the CPU default (tiny.py)."""
