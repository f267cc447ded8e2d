"""Integrations of planarian with agent harnesses."""
