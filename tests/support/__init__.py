"""Helpers the tests share (not tests): hand-built groups, real games and catalogs, Ray nodes in namespaces."""
