"""Tests of deploy/: the `gigpo` command, placement, models, cluster files and the tools."""
