"""Model definitions built from config (the tiny model of the CPU default)."""
