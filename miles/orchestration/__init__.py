"""Orchestration: placement, Ray actor shells, the training loops and the driver that wires them."""
