"""Tests of learner/: advantages, loss, batching, the DeepSpeed trainer and the loop."""
