"""Whole runs with every real part: one node, two nodes, faults, the real model."""
