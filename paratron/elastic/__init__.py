"""Elastic runs: change the layout of a running job in memory (docs/elastic.md)."""
