"""Helpers shared by the test suites (generated GeoIP data, a PostgreSQL to test against)."""
