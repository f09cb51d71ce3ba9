"""Tests of actors/: the vLLM inference actor, rollout actors, prompts and action parsing."""
