"""Shared test fixtures. Fixtures used by one test file live in that file."""
