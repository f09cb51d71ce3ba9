"""Tests of env_servers/: ALFWorld, WebShop and the env pool."""
