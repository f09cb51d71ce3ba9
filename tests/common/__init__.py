"""Tests of common/: records and their wire format, the stream, config, metrics, weight sync, actor calls."""
